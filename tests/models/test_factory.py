"""saopd.models.factory: the testbeds' model wrappers are loaded only when a config asks."""

from __future__ import annotations

import json
import subprocess
import sys

WRAPPERS_ON_DEMAND = """
import json, sys
import saopd.train, saopd.evaluate, saopd.cli
after_entry_points = sorted(m for m in sys.modules if m.startswith("saopd.testbeds"))
from saopd.config.model import ModelConfig, PlantedConfig, TicConfig
from saopd.models.factory import MODEL_WRAPPERS, build_model
listed = MODEL_WRAPPERS.names()
after_listing = sorted(m for m in sys.modules if m.startswith("saopd.testbeds"))
planted, _ = build_model(ModelConfig(tiny="qwen3", planted=PlantedConfig(
    spurious_tokens=[" so", " step"], spurious_bonus=2.5)))
after_planted = sorted(m for m in sys.modules if m.startswith("saopd.testbeds"))
tic, _ = build_model(ModelConfig(tiny="qwen3", tic=TicConfig(rate=0.25)))
plain, _ = build_model(ModelConfig(tiny="qwen3"))
print(json.dumps({
    "after_entry_points": after_entry_points, "listed": listed,
    "after_listing": after_listing, "after_planted": after_planted,
    "planted": type(planted).__module__ + "." + type(planted).__name__,
    "bonus": float(planted.spurious_bias.max()),
    "tic": type(tic).__module__ + "." + type(tic).__name__, "tic_rate": float(tic.rate),
    "plain": type(plain).__module__,
}))
"""


def test_entry_points_import_no_testbed_and_a_config_still_builds_its_wrapper() -> None:
    out = subprocess.run([sys.executable, "-c", WRAPPERS_ON_DEMAND], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after_entry_points"] == []  # saopd-train and saopd-eval import no testbed
    assert got["listed"] == ["planted", "tic"]  # declared, so listed in errors and help
    assert got["after_listing"] == []  # listing imports nothing
    assert got["after_planted"] == ["saopd.testbeds", "saopd.testbeds.planted"]
    assert got["planted"] == "saopd.testbeds.planted.PlantedPriorLM"
    assert got["bonus"] == 2.5
    assert got["tic"] == "saopd.testbeds.tic.TicPriorLM"
    assert got["tic_rate"] == 0.25
    assert not got["plain"].startswith("saopd.testbeds")
