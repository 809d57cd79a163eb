"""The experiment harness (noloco_jax.experiments.harness) applies overrides with ml_collections' own parsing."""

from __future__ import annotations

import pathlib

import pytest

from noloco_jax.experiments import harness

ROOT = pathlib.Path(__file__).resolve().parents[1]

CONFIG = ROOT / "configs" / "tiny_noloco.py"


def test_overrides_are_typed_like_the_cli():
    cfg = harness.load_config(CONFIG, {"outer.sync_every": 7, "optim.learning_rate": 1,
                                       "outer.gamma": 0.3, "model.preset": "nano"})  # fmt: skip
    assert (cfg.outer.sync_every, cfg.outer.gamma, cfg.model.preset) == (7, 0.3, "nano")
    assert isinstance(cfg.optim.learning_rate, float) and cfg.optim.learning_rate == 1.0
    cfg.extra_field = 1  # the returned config is unlocked again, as before


def test_misspelt_or_mistyped_overrides_are_errors():
    with pytest.raises(KeyError, match="gama"):  # was silently added as a new field
        harness.load_config(CONFIG, {"outer.gama": 1.0})
    with pytest.raises(KeyError, match="nosuch"):
        harness.load_config(CONFIG, {"nosuch.x": 1})
    with pytest.raises(TypeError, match="seq_len"):
        harness.load_config(CONFIG, {"data.seq_len": "long"})
