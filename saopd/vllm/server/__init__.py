"""The ``saopd-serve`` server: vLLM's OpenAI-compatible server with saopd's worker extension
(:mod:`saopd.vllm.worker`), run in the environment that has ``vllm``.

- :mod:`~saopd.vllm.server.cli`: the command line (checks its arguments, then becomes vLLM's
  server; ``saopd-serve`` and ``python -m saopd.serve``);
- :mod:`~saopd.vllm.server.guard`: the ASGI middleware in front of every endpoint (the key,
  the allowed worker methods, the broken state after a failed reload);
- :mod:`~saopd.vllm.server.auth`: the shared secret between a server and its clients (the
  server's key, and how a client reads it).
"""
