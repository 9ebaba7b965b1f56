"""Data-parallel plumbing that needs no second process: batch split, strategies, config checks."""

from __future__ import annotations

import pytest
from torch import nn

from saopd.config import to_train_config
from saopd.lightning.data import StepBatchSampler
from saopd.lightning.trainer import data_parallel_size, strategy
from saopd.models.sharding import decoder_layers


def test_ranks_split_each_step_into_contiguous_shares() -> None:
    one = StepBatchSampler(10, 6, 4, seed=3)
    ranks = [list(StepBatchSampler(10, 6, 4, seed=3, rank=r, world_size=3)) for r in range(3)]
    for step, batch in enumerate(one):
        assert len(batch) == 6
        assert [i for r in range(3) for i in ranks[r][step]] == batch  # rank order = batch order


def test_indivisible_batch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"prompts_per_step \(5\).*divisible.*\(2\)"):
        StepBatchSampler(10, 5, 2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="rank"):
        StepBatchSampler(10, 4, 2, rank=2, world_size=2)


def test_strategies_are_built_from_the_config(make_cfg) -> None:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    ddp = strategy(to_train_config(make_cfg("experiment=tiny", "trainer=cpu_ddp")))
    assert isinstance(ddp, DDPStrategy)
    assert ddp.process_group_backend == "gloo"
    conf = to_train_config(make_cfg("experiment=tiny", "trainer=cpu_ddp", "trainer.strategy=fsdp",
                                    "trainer.devices=2", "trainer.num_nodes=3"))
    fsdp = strategy(conf)
    assert isinstance(fsdp, ModelParallelStrategy)
    assert fsdp._data_parallel_size == 6 and fsdp._tensor_parallel_size == 1
    assert strategy(to_train_config(make_cfg("experiment=tiny"))) == "auto"


def test_fsdp_on_cpu_needs_a_device_count(make_cfg) -> None:
    conf = to_train_config(make_cfg("experiment=tiny", "trainer.strategy=fsdp",
                                    "trainer.devices=auto"))
    with pytest.raises(ValueError, match="devices as a number"):
        data_parallel_size(conf)


def test_fsdp_mixed_precision_needs_fsdp(make_cfg) -> None:
    with pytest.raises(ValueError, match=r"fsdp_mixed_precision applies to trainer\.strategy=fsdp"):
        to_train_config(make_cfg("experiment=tiny", "trainer.fsdp_mixed_precision=bf16"))
    with pytest.raises(ValueError, match="process_group_backend must be one of"):
        to_train_config(make_cfg("experiment=tiny", "trainer.process_group_backend=mpi"))


def test_sharding_needs_decoder_layers(tiny_tok) -> None:
    with pytest.raises(ValueError, match="decoder layers of Sequential"):
        decoder_layers(nn.Sequential(nn.Linear(2, 2)))
    from saopd.models.tiny import tiny_qwen3

    model = tiny_qwen3(tiny_tok, layers=3)
    assert len(decoder_layers(model)) == 3
