"""Everything saopd does with vLLM, in one package: the colocated engine, the ``saopd-serve``
server and the trainer's clients of such servers.

The trainer reaches this package through thin registered adapters only
(:mod:`saopd.rollout.adapters` for ``rollout=vllm`` / ``vllm_server``, the factories of
:mod:`saopd.scoring.registry` for ``teacher_scoring=vllm`` / ``vllm_server``), which import it
when such an engine or scorer is built. It is the only package of saopd that imports ``vllm``
itself (the import contract in pyproject.toml), and only inside the functions that need it:
every module here imports without ``vllm`` installed. (Inside this package ``import vllm`` is
the ``vllm`` distribution: Python 3 imports are absolute.)

The colocated engine (``rollout=vllm``, a ``vllm.LLM`` in or beside the training process):

- :mod:`~saopd.vllm.engine`: :class:`~saopd.vllm.engine.VLLMEngine`, built from the student,
  synced after every optimizer step;
- :mod:`~saopd.vllm.sampling`: how it samples (requests, raw sampler log-probs, seeds, images);
- :mod:`~saopd.vllm.sync`: the weight sync (buckets, shards, names, the check that it landed);
- :mod:`~saopd.vllm.tp`: tensor parallelism across training ranks and the start-up deadlines;
- :mod:`~saopd.vllm.runtime`: the process care around an engine started in a training process
  (importing vLLM, RNG and thread state, the engine core's environment, the KV cache on CPU);
- :mod:`~saopd.vllm.shutdown`: shutting an engine down, the one way every engine does;
- :mod:`~saopd.vllm.teacher`: ``teacher_scoring=vllm``, a ``vllm.LLM`` of the teacher.

What runs inside vLLM, whoever started it:

- :mod:`~saopd.vllm.worker`: the worker extension (weight reloads and checks, the server's
  identity and weight digests);
- :mod:`~saopd.vllm.scratch`: scratch folders and their owners (sync shards, saved models);
- :mod:`~saopd.vllm.weights_files`: weight files, their headers and digests;
- :mod:`~saopd.vllm.identity`: the served model's identity (the config values compared);
- :mod:`~saopd.vllm.prompt_logprobs`: teacher scores from vLLM's ``prompt_logprobs``.

The server (:mod:`saopd.vllm.server`): the ``saopd-serve`` command line
(:mod:`~saopd.vllm.server.cli`), the guard in front of every endpoint
(:mod:`~saopd.vllm.server.guard`) and the API key (:mod:`~saopd.vllm.server.auth`).

The trainer's side of the servers (:mod:`saopd.vllm.client`): JSON over HTTP
(:mod:`~saopd.vllm.client.http`), ``rollout=vllm_server``
(:mod:`~saopd.vllm.client.rollout` over one client per server,
:mod:`~saopd.vllm.client.rollout_server`) and ``teacher_scoring=vllm_server``
(:mod:`~saopd.vllm.client.teacher` over :mod:`~saopd.vllm.client.teacher_server`). The clients
need no ``vllm``: the trainer's environment need not have it.
"""
