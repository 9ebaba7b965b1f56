"""The vLLM engines' registered adapters (saopd.rollout.adapters): importing saopd.rollout and
saopd.scoring registers every engine and backend without importing saopd.vllm or vllm, and each
adapter builds its engine with that engine's own from_config."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from saopd.rollout import ENGINES
from saopd.rollout.adapters import VLLMAdapter, VLLMServerAdapter
from saopd.vllm.client.rollout import VLLMServerEngine
from saopd.vllm.engine import VLLMEngine


def test_importing_the_registries_imports_no_vllm_code() -> None:
    code = ("import sys; import saopd.rollout, saopd.scoring.registry; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.') "
            "or m.startswith('saopd.vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"
    assert ENGINES.names() == ["hf", "vllm", "vllm_server"]


def test_each_adapter_builds_its_engine_through_the_engines_from_config(monkeypatch) -> None:
    assert ENGINES.get("vllm") is VLLMAdapter and ENGINES.get("vllm_server") is VLLMServerAdapter
    assert VLLMAdapter.engine_class() is VLLMEngine
    assert VLLMServerAdapter.engine_class() is VLLMServerEngine
    assert (VLLMEngine.name, VLLMServerEngine.name) == ("vllm", "vllm_server")
    for adapter, engine in ((VLLMAdapter, VLLMEngine), (VLLMServerAdapter, VLLMServerEngine)):
        seen: list[Any] = []

        def from_config(cls: type, *args: Any, _seen: list[Any] = seen) -> str:
            _seen.append((cls, args))
            return "built"

        monkeypatch.setattr(engine, "from_config", classmethod(from_config))
        assert adapter.from_config("conf", "student", "tokenizer", "setup") == "built"
        assert seen == [(engine, ("conf", "student", "tokenizer", "setup"))]
        assert adapter.holds_weights and engine.holds_weights
