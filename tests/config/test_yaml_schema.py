"""Every key of every YAML file under conf/ exists in the schema it is merged onto, and the
files of the typed groups hold only what differs from the schema's defaults (the defaults live
once, in saopd/config and the registries' dataclasses)."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from saopd.config import (
    ROLLOUT_SCHEMAS,
    DataConfig,
    LoggerConfig,
    ModelConfig,
    TrainConfig,
    TrainerConfig,
)
from saopd.filters import FILTERS
from saopd.objectives import OBJECTIVES

CONF = Path(__file__).resolve().parents[2] / "conf"
GROUP_SCHEMAS: dict[str, type] = {"model": ModelConfig, "data": DataConfig,
                                  "trainer": TrainerConfig, "logger": LoggerConfig}
HYDRA_KEYS = {"defaults", "hydra"}


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) or {}


def _dataclass_of(tp: Any) -> type | None:
    """The dataclass inside a field type (``X``, ``X | None``, ``Optional[X]``)."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    for arg in typing.get_args(tp):
        found = _dataclass_of(arg)
        if found is not None:
            return found
    return None


def _fields(schema: type) -> dict[str, dataclasses.Field]:
    hints = typing.get_type_hints(schema)
    out = {}
    for f in dataclasses.fields(schema):
        f.type = hints[f.name]
        out[f.name] = f
    return out


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
    return dataclasses.MISSING


def _variant_fields(registry: Any) -> set[str]:
    """The hyperparameters of every registered variant (a global file may set any of them)."""
    return {"name"} | {f.name for name in registry for f in dataclasses.fields(registry.get(name))}


def _unknown(node: dict[str, Any], schema: type, where: str) -> list[str]:
    """Keys of ``node`` (recursively) that ``schema`` does not have."""
    fields = _fields(schema)
    bad = []
    for key, value in node.items():
        if key not in fields:
            bad.append(f"{where}{key}")
            continue
        sub = _dataclass_of(fields[key].type)
        if key in ("filter", "objective") and schema is TrainConfig and isinstance(value, dict):
            allowed = _variant_fields(FILTERS if key == "filter" else OBJECTIVES)
            bad += [f"{where}{key}.{k}" for k in value if k not in allowed]
        elif key == "rollout" and schema is TrainConfig and isinstance(value, dict):
            allowed = {f.name for s in ROLLOUT_SCHEMAS.values() for f in dataclasses.fields(s)}
            bad += [f"{where}{key}.{k}" for k in value if k not in allowed]
        elif sub is not None and isinstance(value, dict):
            bad += _unknown(value, sub, f"{where}{key}.")
    return bad


def _restated(node: dict[str, Any], schema: type, where: str) -> list[str]:
    """Keys of ``node`` whose value equals the schema's default (recursively)."""
    fields = _fields(schema)
    out = []
    for key, value in node.items():
        f = fields.get(key)
        if f is None:
            continue
        sub = _dataclass_of(f.type)
        if sub is not None and isinstance(value, dict):
            out += _restated(value, sub, f"{where}{key}.")
        elif _default(f) is not dataclasses.MISSING and value == _default(f):
            out.append(f"{where}{key}: {value!r}")
    return out


def _group_files(group: str) -> list[Path]:
    return sorted((CONF / group).glob("*.yaml"))


def _cases() -> list[tuple[str, Path]]:
    cases = [("train", CONF / "train.yaml")]
    for group in [*GROUP_SCHEMAS, "rollout", "filter", "objective", "experiment", "method",
                  "study"]:
        cases += [(group, path) for path in _group_files(group)]
    return cases


@pytest.mark.parametrize(("group", "path"), _cases(), ids=lambda x: getattr(x, "name", x))
def test_every_yaml_key_exists_in_its_schema(group: str, path: Path) -> None:
    node = {k: v for k, v in _load(path).items() if k not in HYDRA_KEYS}
    if group in GROUP_SCHEMAS:
        bad = _unknown(node, GROUP_SCHEMAS[group], f"{group}.")
    elif group == "rollout":
        bad = _unknown(node, ROLLOUT_SCHEMAS[path.stem], "rollout.")
    elif group in ("filter", "objective"):
        registry = FILTERS if group == "filter" else OBJECTIVES
        allowed = {"name"} | {f.name for f in dataclasses.fields(registry.get(node["name"]))}
        bad = [f"{group}.{k}" for k in node if k not in allowed]
    else:  # train.yaml and the @package _global_ files: the whole TrainConfig
        bad = _unknown(node, TrainConfig, "")
    assert not bad, f"{path.relative_to(CONF)}: keys not in the schema: {bad}"


@pytest.mark.parametrize(("group", "path"),
                         [c for c in _cases() if c[0] in (*GROUP_SCHEMAS, "rollout", "train")],
                         ids=lambda x: getattr(x, "name", x))
def test_typed_yaml_files_hold_only_what_differs_from_the_defaults(group: str,
                                                                    path: Path) -> None:
    node = {k: v for k, v in _load(path).items() if k not in HYDRA_KEYS}
    schema = {"train": TrainConfig, "rollout": ROLLOUT_SCHEMAS.get(path.stem)}.get(
        group, GROUP_SCHEMAS.get(group))
    restated = _restated(node, schema, "" if group == "train" else f"{group}.")
    assert not restated, f"{path.relative_to(CONF)} restates schema defaults: {restated}"


def test_the_checks_see_a_typo_and_a_restated_default() -> None:
    assert _unknown({"optim": {"lrr": 1.0}}, TrainConfig, "") == ["optim.lrr"]
    assert _unknown({"filter": {"p3": 1}}, TrainConfig, "") == ["filter.p3"]
    assert _restated({"optim": {"lr": 1e-6}}, TrainConfig, "") == ["optim.lr: 1e-06"]
    assert _restated({"rollout": {"n": 2}}, TrainConfig, "") == []  # Any-typed: not checked
