"""Tracking: TensorBoard and a W&B offline run get the field's metric names (W&B 0.31 silently
wrote no history with resume="allow" offline: this test reads the offline run's file)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.config.run import RunConfig, RunSection, WandbConfig
from orchestrator.observe.tracking import Tracking

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)


def test_wandb_offline_and_tensorboard_get_the_field_names(tmp_path: Path, monkeypatch):
    # wandb-core (0.31) writes no history when PYTEST_CURRENT_TEST is in its environment (measured)
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    config = RunConfig(run=RunSection(wandb=WandbConfig(project="inflight-test"))).validate()
    tracking = Tracking(tmp_path, config, "run0123")
    step = SimpleNamespace(step=3, reward_mean=0.5, loss=0.1, seconds=1.5, metrics={"kl_k3": 0.01, "grad_norm": 2.0})
    tracking.step_done(step, [0, 1, 2], {"digit_share": 0.5}, 120.0)
    activation = SimpleNamespace(engines=[SimpleNamespace(engine="engine-0", pause_s=0.02, transfer_s=0.1)])
    tracking.activation(activation)
    tracking.evaluation(SimpleNamespace(task="heldout", k=4, pass_at_k=0.25, mean_at_k=0.4, components={}))
    tracking.step_done(SimpleNamespace(step=2, reward_mean=None, loss=None, seconds=None, metrics={}), [1], {}, None)
    assert tracking.step == 3  # never back in time: W&B drops points at older steps
    tracking.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()
    for name in ("reward/mean", "reward/digit_share", "staleness/mean", "staleness/max", "mismatch/kl",
                 "timing/pause_s", "timing/step_s", "throughput/tokens_per_s", "eval/heldout/pass@4",
                 "eval/heldout/mean@4", "trainer/grad_norm"):
        assert name.encode() in data, name
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
