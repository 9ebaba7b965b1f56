"""``python -m saopd.serve``: the ``saopd-serve`` command (:func:`saopd.vllm.server.cli.main`),
for environments where the console script is not on ``PATH``. Importing it needs no ``vllm``."""

from __future__ import annotations

from saopd.vllm.server.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
