"""Pure parts of the replay analysis: the estimators, bucketing, batching and layering."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from replay.analysis.dataset import parse_steps
from replay.analysis.recompute import plan_batches
from replay.analysis.stats import bucketed, summarize


@pytest.mark.timeout(30)
def test_estimators_match_their_formulas():
    r = np.array([0.0, np.log(2.0), np.log(0.5), np.log(3.0)])
    w = np.exp(r)
    out = summarize(r, clip=2.0)
    assert out["tokens"] == 4
    assert out["kl_k1"] == pytest.approx(-r.mean())
    assert out["kl_k2"] == pytest.approx(0.5 * (r ** 2).mean())
    assert out["kl_k3"] == pytest.approx(((w - 1) - r).mean())
    assert out["ess_fraction"] == pytest.approx(w.sum() ** 2 / (4 * (w ** 2).sum()))
    assert out["clip_fraction"] == pytest.approx(0.25)  # only w = 3 exceeds 2
    assert out["ratio_p50"] == pytest.approx(1.0)  # nearest rank: 2nd of [0.5, 1, 2, 3]
    assert out["ratio_p99"] == pytest.approx(3.0)
    assert out["ratio_mean"] == pytest.approx(w.mean())


@pytest.mark.timeout(30)
def test_identical_policies_have_zero_divergence_and_full_ess():
    out = summarize(np.zeros(10))
    assert out["kl_k1"] == out["kl_k2"] == out["kl_k3"] == 0.0
    assert out["ess_fraction"] == 1.0 and out["clip_fraction"] == 0.0


@pytest.mark.timeout(30)
def test_empty_bucket_and_huge_ratios_stay_finite():
    assert summarize(np.zeros(0))["kl_k3"] is None
    out = summarize(np.array([1000.0, -1000.0]))
    assert np.isfinite(out["kl_k3"]) and np.isfinite(out["ratio_mean"])


@pytest.mark.timeout(30)
def test_buckets_keep_negative_lags_and_split_by_span_position_carry():
    r = np.array([0.1, -0.1, 0.2, 0.0, 0.3])
    lag = np.array([-1, 0, 0, 2, 2])
    multi = np.array([False, False, True, True, True])
    position = np.array([0, 1, 5, 20, 300])
    carried = np.array([False, False, False, True, True])
    out = bucketed(r, lag, multi, position, carried)
    assert [row["lag"] for row in out["by_lag"]] == [-1, 0, 2]
    assert [row["tokens"] for row in out["by_lag"]] == [1, 2, 2]
    assert {row["span"]: row["tokens"] for row in out["by_span"]} == {"single": 2, "multi": 3}
    assert [row["position"] for row in out["by_position"]] == ["0", "1-3", "4-15", "16-63", "256-1023"]
    assert {row["kv_carried"]: row["tokens"] for row in out["by_kv_carried"]} == {False: 3, True: 2}
    assert out["overall"]["tokens"] == 5


@pytest.mark.timeout(30)
def test_batches_respect_the_token_budget_and_cover_every_sequence():
    lengths = [5, 100, 7, 60, 60, 3, 250]
    batches = plan_batches(lengths, token_budget=128)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) == 1 or max(lengths[i] for i in batch) * len(batch) <= 128


@pytest.mark.timeout(30)
def test_parse_steps():
    assert parse_steps(None) == (None, None)
    assert parse_steps("2:5") == (2, 5)
    assert parse_steps("3:") == (3, None)
    assert parse_steps(":4") == (None, 4)
    assert parse_steps("7") == (7, 7)


@pytest.mark.timeout(120)
def test_replay_analysis_imports_neither_orchestrator_nor_transports():
    code = ("import sys; import replay.analysis.analyze, replay.analysis.report, replay.bench.analysis, "
            "replay.cli_replay; bad = [m for m in sys.modules if m.split('.')[0] in "
            "('orchestrator', 'transports')]; print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=110)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.timeout(60)
def test_replay_is_registered_without_heavy_imports():
    code = ("import sys; from orchestrator.commands.cli import build_parser; p = build_parser(); "
            "a = p.parse_args(['replay', 'RUN', '--target', '3', '--steps', '1:2', '--verify-spans']); "
            "b = p.parse_args(['bench', 'replay-analysis', '--json']); "
            "assert a.target == '3' and a.verify_spans and b.json; "
            "heavy = [m for m in ('torch', 'transformers', 'matplotlib') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    result = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=55)
    assert result.returncode == 0, result.stdout + result.stderr
