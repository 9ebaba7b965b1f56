"""The trainer's side of ``saopd-serve`` servers: no ``vllm`` needed.

- :mod:`~saopd.vllm.client.http`: JSON over HTTP with one server, every error naming it;
- :mod:`~saopd.vllm.client.rollout`: ``rollout=vllm_server``
  (:class:`~saopd.vllm.client.rollout.VLLMServerEngine`: samples from and syncs the servers);
- :mod:`~saopd.vllm.client.rollout_server`: one rollout server's client (its model, its
  identity, its weight reloads);
- :mod:`~saopd.vllm.client.teacher`: ``teacher_scoring=vllm_server``
  (:class:`~saopd.vllm.client.teacher.VLLMServerTeacherScorer`);
- :mod:`~saopd.vllm.client.teacher_server`: one teacher server's client and the proof that it
  serves the teacher.
"""
