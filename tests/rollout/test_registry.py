"""rollout=vllm wiring that needs no vLLM: the weight-bucket gatherer (plain tensors and 2-rank
FSDP2-style DTensor shards over gloo), name canonicalisation, the config group and its range
checks, the importance-ratio default per engine, the factory's refusals, and the clear error
when vllm is not installed. Each engine's options are written once: every field of its config
dataclass reaches an engine parameter (or a request, or is named here as consumed elsewhere),
with the config's default, and build_engine passes each through; conf/rollout/*.yaml hold no
option of their own. The engine itself is tested on real vLLM in tests/integration/vllm/."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import os
import re
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
import yaml

from saopd.config import ROLLOUT_SCHEMAS, rollout_schema_name, to_train_config
from saopd.config.rollout import HFRolloutConfig, RolloutConfig, VLLMRolloutConfig
from saopd.data_parallel import num_training_processes
from saopd.paths import conf_dir
from saopd.rollout import ENGINES, HFGenerateEngine, SamplingParams
from saopd.rollout.registry import build_engine
from saopd.vllm.engine import ENGINE_OPTIONS, VLLMEngine
from saopd.vllm.sync import canonical_weight_name, iter_full_tensor_buckets
from tests.conftest import compose_train
from tests.helpers.net import free_port

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def test_saopd_rollout_vllm_imports_without_vllm() -> None:
    import saopd.vllm.engine as module

    assert module.VLLMEngine.holds_weights


def test_buckets_respect_the_size_and_keep_order() -> None:
    tensors = [(f"w{i}", torch.full((n,), float(i))) for i, n in enumerate([10, 10, 30, 5, 5])]
    buckets = list(iter_full_tensor_buckets(tensors, bucket_bytes=80))  # 20 float32
    assert [[n for n, _ in b] for b in buckets] == [["w0", "w1"], ["w2"], ["w3", "w4"]]
    flat = [t for b in buckets for _, t in b]
    assert all(a.data_ptr() == b.data_ptr() for a, (_, b) in zip(flat, tensors, strict=True))
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 1"):
        list(iter_full_tensor_buckets(tensors, bucket_bytes=0))


def _dtensor_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        full = {"a": torch.arange(12.0).reshape(6, 2), "b": torch.arange(8.0) * -1,
                "c": torch.ones(4, 3)}
        named = [(n, distribute_tensor(t, mesh, [Shard(0)])) for n, t in full.items()]
        assert all(t.to_local().shape[0] == full[n].shape[0] // 2 for n, t in named)
        got = [[(n, t.clone()) for n, t in b]
               for b in iter_full_tensor_buckets(named, bucket_bytes=64)]
        if rank == 0:
            torch.save(got, out)
    finally:
        dist.destroy_process_group()


def test_dtensor_shards_are_gathered_to_full_tensors_per_bucket(tmp_path: Path) -> None:
    out = str(tmp_path / "got.pt")
    mp.start_processes(_dtensor_worker, args=(free_port(), out), nprocs=2, join=True,
                       start_method="spawn")
    got = torch.load(out)
    assert [[n for n, _ in b] for b in got] == [["a"], ["b"], ["c"]]  # 48, 32 (+48 > 64), 48 B
    assert torch.equal(got[0][0][1], torch.arange(12.0).reshape(6, 2))
    assert torch.equal(got[1][0][1], torch.arange(8.0) * -1)
    assert torch.equal(got[2][0][1], torch.ones(4, 3))


def test_canonical_weight_names() -> None:
    assert canonical_weight_name("model._orig_mod.layers.0.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert canonical_weight_name(
        "model.layers.1._checkpoint_wrapped_module.self_attn.q_proj.weight") == \
        "model.layers.1.self_attn.q_proj.weight"
    assert canonical_weight_name("lm_head.weight") == "lm_head.weight"


def test_vllm_config_group_and_importance_ratio_default(tmp_path: Path) -> None:
    hf = to_train_config(compose_train(tmp_path, "experiment=tiny"))
    assert hf.rollout.engine == "hf" and hf.objective["importance_ratio_cap"] is None
    vl = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm"))
    assert vl.rollout.engine == "vllm" and vl.objective["importance_ratio_cap"] == 5.0
    assert (vl.rollout.n, vl.rollout.max_new_tokens) == (2, 12)  # the experiment's values stay
    ex = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm",
                                       "objective=exopd"))
    assert ex.objective["importance_ratio_cap"] == 5.0
    off = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm",
                                        "objective.importance_ratio_cap=null"))
    assert off.objective["importance_ratio_cap"] is None
    kl = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm",
                                       "objective=full_kl"))
    assert "importance_ratio_cap" not in kl.objective


@pytest.mark.parametrize(("override", "match"), [
    ("rollout.engine=sglang",
     r"rollout.engine is 'vllm' in conf/rollout/vllm.yaml, got 'sglang': .*rollout=<engine>"),
    ("rollout.sleep_level=3", r"rollout.sleep_level must be one of \[1, 2\], got 3"),
    ("rollout.gpu_memory_utilization=0",
     r"rollout.gpu_memory_utilization must be a number in \(0.0, 1.0\]"),
    ("rollout.gpu_memory_utilization=1.5",
     r"rollout.gpu_memory_utilization must be a number in \(0.0, 1.0\], got 1.5"),
    ("rollout.kv_cache_gb=-1", r"rollout.kv_cache_gb must be null or a number > 0.0"),
    ("rollout.weight_bucket_mb=0", r"rollout.weight_bucket_mb must be an int >= 1, got 0"),
    ("rollout.tensor_parallel_size=0", r"rollout.tensor_parallel_size must be an int >= 1"),
    ("rollout.sync_transport=nccl", r"rollout.sync_transport must be one of"),
    ("rollout.dtype=int8", r"rollout.dtype must be one of"),
    ("rollout.importance_ratio_cap=0", r"rollout.importance_ratio_cap must be > 0"),
])
def test_bad_vllm_values_name_the_key(override: str, match: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=match):
        to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm", override))


def test_several_processes_get_colocated_engines(tmp_path: Path, tiny_tok, monkeypatch) -> None:
    from saopd.models.tiny import tiny_qwen3
    from saopd.vllm.engine import VLLMEngine

    model = tiny_qwen3(tiny_tok)
    # one engine per rank: out of process, a folder per rank, the rank's local device
    seen: dict = {}

    def fake_from_model(cls, student, tokenizer, **kw):
        seen.update(kw)
        return "engine"

    monkeypatch.setattr(VLLMEngine, "from_model", classmethod(fake_from_model))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "3")
    conf = to_train_config(compose_train(tmp_path, "experiment=tiny", "rollout=vllm",
                                         f"rollout.model_dir={tmp_path / 'm'}")).rollout
    assert conf.in_process  # the default, overridden for colocated engines
    assert build_engine(conf, model, tiny_tok, devices=2, num_nodes=2) == "engine"
    assert seen["in_process"] is False and seen["local_rank"] == 1
    assert seen["model_dir"] == str(tmp_path / "m" / "rank3")
    assert "colocated_tensor_parallel" not in seen
    seen.clear()
    build_engine(conf, model, tiny_tok, devices=1)  # one process: as configured
    assert seen["in_process"] is True and seen["local_rank"] is None
    assert num_training_processes("1") == 1 and num_training_processes([0, 1, 2]) == 3


def test_several_processes_share_tensor_parallel_engines(tmp_path: Path, tiny_tok,
                                                         monkeypatch) -> None:
    from saopd.models.tiny import tiny_qwen3
    from saopd.vllm.engine import VLLMEngine

    model = tiny_qwen3(tiny_tok)
    seen: dict = {}

    def fake_from_model(cls, student, tokenizer, **kw):
        seen.update(kw)
        return "engine"

    monkeypatch.setattr(VLLMEngine, "from_model", classmethod(fake_from_model))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "1")
    conf = to_train_config(compose_train(
        tmp_path, "experiment=tiny", "rollout=vllm", "rollout.tensor_parallel_size=2",
        "rollout.in_process=false", f"rollout.model_dir={tmp_path / 'm'}")).rollout
    # a shard of the engine ranks 0 and 1 share: in process (external launcher), no local
    # device of its own to narrow to, the rank's own folder
    assert build_engine(conf, model, tiny_tok, devices=2) == "engine"
    assert seen["colocated_tensor_parallel"] is True and seen["in_process"] is True
    assert seen["local_rank"] is None and seen["tensor_parallel_size"] == 2
    assert seen["model_dir"] == str(tmp_path / "m" / "rank1")
    build_engine(conf, model, tiny_tok, devices=[0, 1], num_nodes=2)  # 2 groups, one per node
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide the number of "
                                         r"training processes \(3\)"):
        build_engine(conf, model, tiny_tok, devices=3)
    conf4 = dataclasses.replace(conf, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"must divide the training processes per node \(2\).*"
                                         r"stays within a node"):
        build_engine(conf4, model, tiny_tok, devices=2, num_nodes=2)
    ahead = dataclasses.replace(conf, async_steps=1)
    with pytest.raises(ValueError, match=r"rollout.async_steps=1 with "
                                         r"rollout.tensor_parallel_size > 1"):
        build_engine(ahead, model, tiny_tok, devices=2)


def test_a_colocated_engine_starts_in_a_clean_environment(monkeypatch) -> None:
    import os

    from saopd.data_parallel import training_rank
    from saopd.vllm.runtime import LAUNCHER_VARIABLES, engine_environment

    for key in LAUNCHER_VARIABLES:
        monkeypatch.setenv(key, "7")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("RANK", "5")
    assert training_rank() == (5, 1)
    with engine_environment(1):
        assert not any(key in os.environ for key in LAUNCHER_VARIABLES)
    assert os.environ["MASTER_PORT"] == "7" and os.environ["RANK"] == "5"  # restored
    with engine_environment(None):  # one training process: untouched
        assert os.environ["MASTER_ADDR"] == "7"
    monkeypatch.delenv("RANK")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("NODE_RANK", "2")
    assert training_rank() == (9, 1)  # Lightning's launch: node 2 x 4 per node + local 1


@pytest.mark.skipif(HAS_VLLM, reason="vllm is installed here")
def test_missing_vllm_is_a_clear_user_error(make_cfg) -> None:
    from saopd.train import UserError, train

    cfg = make_cfg("experiment=tiny", "rollout=vllm", "steps=1", mlflow=False)
    with pytest.raises(UserError, match=r"rollout: rollout=vllm needs the vllm package.*"
                                        r"make setup-vllm"):
        train(cfg)


# ---- options written once: config dataclass <-> engine parameters ---------------------------
#: RolloutConfig fields that no engine constructor takes, and who reads them instead.
NOT_ENGINE_PARAMETERS = {
    "engine": "the registry key (build_engine)",
    "importance_ratio_cap": "the sampled objectives' default (conf/objective/{sampled,exopd}.yaml)",
    "async_steps": "the rollout callback (saopd.lightning.callbacks.RolloutCallback)",
}
#: RolloutConfig fields that every engine's from_config passes to its constructor.
SHARED_ENGINE_PARAMETERS = {"greedy"}
#: RolloutConfig fields sent with each request (saopd.rollout.SamplingParams).
PER_REQUEST = {f.name for f in fields(RolloutConfig)} & {f.name for f in fields(SamplingParams)}
SHARED = {f.name for f in fields(RolloutConfig)}


def _default(schema: type, name: str) -> Any:
    (field,) = [f for f in fields(schema) if f.name == name]
    assert field.default is not MISSING, f"{schema.__name__}.{name} has no plain default"
    return field.default


def _keyword_default(function: Any, name: str) -> Any:
    """The default of ``function``'s keyword parameter ``name`` (fails when it has none)."""
    param = inspect.signature(function).parameters.get(name)
    assert param is not None, f"{function.__qualname__} has no parameter {name!r}"
    assert param.kind is inspect.Parameter.KEYWORD_ONLY, f"{name} is not keyword-only"
    assert param.default is not inspect.Parameter.empty, f"{name} has no default"
    return param.default


def test_shared_rollout_fields_each_reach_a_request_an_engine_or_a_named_reader() -> None:
    assert sorted(PER_REQUEST) == ["max_new_tokens", "n", "temperature", "top_p"]
    unplaced = SHARED - PER_REQUEST - SHARED_ENGINE_PARAMETERS - set(NOT_ENGINE_PARAMETERS)
    assert not unplaced, f"RolloutConfig fields that reach no engine or request: {unplaced}"
    objective = (conf_dir() / "objective" / "sampled.yaml").read_text()
    assert "${rollout.importance_ratio_cap}" in objective


def test_vllm_engine_options_are_init_keywords_with_the_config_defaults() -> None:
    assert ENGINE_OPTIONS and not set(ENGINE_OPTIONS) & SHARED
    for name in (*ENGINE_OPTIONS, *SHARED_ENGINE_PARAMETERS):
        assert _keyword_default(VLLMEngine.__init__, name) == _default(VLLMRolloutConfig, name), \
            name
    assert _keyword_default(VLLMEngine.from_model, "model_dir") == \
        _default(VLLMRolloutConfig, "model_dir")


def test_every_vllm_config_field_reaches_the_engine_or_a_request() -> None:
    own = {f.name for f in fields(VLLMRolloutConfig)} - SHARED
    # a new VLLMRolloutConfig field lands in ENGINE_OPTIONS (and the test above then needs an
    # engine parameter of that name); model_dir is from_model's
    assert own == set(ENGINE_OPTIONS) | {"model_dir"}
    assert len(ENGINE_OPTIONS) == len(set(ENGINE_OPTIONS))


#: A value other than the default for every field build_engine passes to VLLMEngine.from_model.
VLLM_NON_DEFAULTS: dict[str, Any] = {
    "greedy": True, "model_dir": "/nonexistent/saopd-model", "dtype": "bfloat16",
    "max_model_len": 777, "gpu_memory_utilization": 0.5, "kv_cache_gb": 0.25,
    "enforce_eager": True, "tensor_parallel_size": 2, "enable_sleep_mode": True,
    "sleep_level": 2, "weight_bucket_mb": 64, "sync_transport": "files", "in_process": False,
    "verify_sync": False, "max_images_per_prompt": 2, "startup_timeout": 123.0,
}


def test_build_engine_passes_every_vllm_option_to_from_model(
        monkeypatch: pytest.MonkeyPatch) -> None:
    missing = {*ENGINE_OPTIONS, *SHARED_ENGINE_PARAMETERS, "model_dir"} - set(VLLM_NON_DEFAULTS)
    assert not missing, f"give these options a non-default value in VLLM_NON_DEFAULTS: {missing}"
    for name, value in VLLM_NON_DEFAULTS.items():
        assert value != _default(VLLMRolloutConfig, name), name
    recorded: dict[str, Any] = {}
    built = object()

    def from_model(cls: type, model: Any, tokenizer: Any, **kwargs: Any) -> object:
        recorded.update(cls=cls, model=model, tokenizer=tokenizer, kwargs=kwargs)
        return built

    monkeypatch.setattr(VLLMEngine, "from_model", classmethod(from_model))
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    conf = VLLMRolloutConfig(n=3, temperature=0.5, max_new_tokens=9, **VLLM_NON_DEFAULTS)
    student, tokenizer, processor = object(), object(), object()
    setup = {"max_prompt_length": 33, "prompt_truncation": "skip", "seed": 7,
             "chat_template_kwargs": {"enable_thinking": False}, "processor": processor}
    assert build_engine(conf, student, tokenizer, **setup) is built
    assert recorded["cls"] is VLLMEngine
    assert recorded["model"] is student and recorded["tokenizer"] is tokenizer
    # every option with the config's value, the run's setup, nothing else (n, temperature and
    # max_new_tokens come with each request)
    assert recorded["kwargs"] == {**VLLM_NON_DEFAULTS, **setup, "local_rank": None}


def test_hf_engine_options_are_init_keywords_with_the_config_defaults() -> None:
    own = [f.name for f in fields(HFRolloutConfig) if f.name not in SHARED]
    assert own == ["batch_size", "sampler", "static_cache"]
    for name in (*own, *SHARED_ENGINE_PARAMETERS):
        assert _keyword_default(HFGenerateEngine.__init__, name) == \
            _default(HFRolloutConfig, name), name


def test_build_engine_passes_every_hf_option(tiny_tok) -> None:
    from saopd.models.tiny import tiny_qwen3

    student = tiny_qwen3(tiny_tok)
    own = {f.name: f.default for f in fields(HFRolloutConfig) if f.name not in SHARED}
    # static_cache samples through model.generate (multinomial only): a second engine for it
    settings = [{"batch_size": 3, "greedy": True, "sampler": "inverse_cdf"},
                {"static_cache": True}]
    assert set().union(*settings) == set(own) | SHARED_ENGINE_PARAMETERS
    for values in settings:
        conf = HFRolloutConfig(**values)
        engine = build_engine(conf, student, tiny_tok, max_prompt_length=40,
                              prompt_truncation="skip", chat_template_kwargs={"x": 1})
        assert isinstance(engine, HFGenerateEngine) and engine.model is student
        for name, value in values.items():
            assert getattr(engine, name) == value != _default(HFRolloutConfig, name), name
        assert (engine.max_prompt_length, engine.prompt_truncation,
                engine.chat_template_kwargs) == (40, "skip", {"x": 1})


def test_build_engine_names_the_registered_engines_on_a_miss() -> None:
    assert {"hf", "vllm", "vllm_server"} <= set(ENGINES.names())
    # the engine is looked up before the student or tokenizer are touched
    allowed = ", ".join(ENGINES.names())
    with pytest.raises(ValueError,
                       match=re.escape(f"unknown rollout engine 'sglang'; allowed: {allowed}")):
        build_engine(RolloutConfig(engine="sglang"), None, None)


def test_rollout_yaml_files_hold_only_their_schema() -> None:
    files = sorted((conf_dir() / "rollout").glob("*.yaml"))
    assert [f.stem for f in files] == ENGINES.names() == sorted(ROLLOUT_SCHEMAS)
    for file in files:
        assert yaml.safe_load(file.read_text()) == {
            "defaults": [f"/{rollout_schema_name(file.stem)}", "_self_"]}, file.name
        assert ROLLOUT_SCHEMAS[file.stem]().engine == file.stem
