"""`inflight replay`: recompute every recorded token under a target policy (and, with
`verify_spans`, under its own recorded version) and report how far behaviour and target drifted.

`analyze(run_dir, options)` returns the report (a JSON-ready dict, see docs/replay-analysis.md)
and, when asked for, the per-token table. A version whose weights cannot be found (pruned by
`transport.keep_last`) is skipped and named in `skipped_versions`; the rest is analysed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from replay.analysis.dataset import Dataset, load_dataset, parse_steps
from replay.analysis.recompute import DEFAULT_TOKEN_BUDGET, recompute_logprobs
from replay.analysis.stats import DEFAULT_CLIP, abs_diff_by, bucketed, lag_histogram
from replay.analysis.versions import VersionStore, base_model_dir

DEFAULT_TOLERANCE = 1e-3
EXACT_PRECISIONS = frozenset({"float32", "fp32", "torch.float32"})
Progress = Callable[[str, int | None], Callable[[int], None]]


def _no_progress(_name: str, _total: int | None) -> Callable[[int], None]:
    return lambda _n: None


@dataclass
class Options:
    target: str = "latest"  # "latest", a version number, or a Hugging Face model directory
    limit: int | None = None
    steps: str | None = None  # "A:B"
    clip: float = DEFAULT_CLIP
    verify_spans: bool = False
    tolerance: float = DEFAULT_TOLERANCE
    device: str | None = None  # default: cuda when available, else cpu
    token_budget: int = DEFAULT_TOKEN_BUDGET
    lenient: bool = False
    token_table: bool = False  # also return the per-token table (for --parquet)


class Target:
    def __init__(self, spec: str, data: Dataset) -> None:
        self.spec = spec
        self.version: int | None = None
        self.model_dir: str | None = None
        if spec == "latest":
            self.version = data.latest_version
        elif spec.lstrip("-").isdigit():
            self.version = int(spec)
        else:
            self.model_dir = os.fspath(Path(spec).resolve())
        # Lag is target version - token version; a model directory has no version, so its lags
        # are counted from the newest activated version (named in the report).
        self.lag_reference = self.version if self.version is not None else data.latest_version

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "version": self.version, "model_dir": self.model_dir,
                "lag_reference_version": self.lag_reference}


def _device(option: str | None) -> str:
    if option:
        return option
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class _Skips:
    def __init__(self) -> None:
        self.versions: dict[int, dict[str, Any]] = {}

    def add(self, version: int, reason: str, needed_for: str, tokens: int, rollouts: int) -> None:
        entry = self.versions.setdefault(version, {"version": version, "reason": reason,
                                                   "needed_for": [], "tokens": 0, "rollouts": 0})
        entry["needed_for"].append(needed_for)
        entry["tokens"] += tokens
        entry["rollouts"] += rollouts


def analyze(run_dir: str | os.PathLike[str], options: Options | None = None,
            progress: Progress = _no_progress) -> tuple[dict[str, Any], dict[str, np.ndarray] | None]:
    options = options or Options()
    advance = progress("reading replay log", None)
    data = load_dataset(run_dir, limit=options.limit, steps=parse_steps(options.steps),
                        lenient=options.lenient, on_record=lambda: advance(1))
    device = _device(options.device)
    store = VersionStore(run_dir, base_model_dir(data.meta), device)
    target = Target(options.target, data)
    if target.model_dir is None and target.spec != "latest" and not store.available(target.version):
        # A version asked for by number that the run does not hold: named, never a silent skip.
        raise FileNotFoundError(f"--target {target.spec}: the run has no weights of version {target.version} "
                                f"({store.missing_reason(target.version)}); it holds versions {store.retained()}")
    skips = _Skips()
    rollouts = data.rollouts
    n_tokens = sum(len(r.tokens) for r in rollouts)
    timing = {"recompute_tokens": 0, "recompute_seconds": 0.0}

    def recompute(model, members: list[int], what: str) -> list[np.ndarray]:
        tokens = sum(len(rollouts[i].tokens) for i in members)
        step = progress(what, tokens)
        started = time.perf_counter()
        out = recompute_logprobs(model, [(rollouts[i].prompt, rollouts[i].tokens) for i in members],
                                 temperatures=[rollouts[i].temperature for i in members],
                                 token_budget=options.token_budget, on_tokens=step)
        timing["recompute_seconds"] += time.perf_counter() - started
        timing["recompute_tokens"] += tokens
        return out

    # --- under the target ---------------------------------------------------------------------
    target_logprobs: list[np.ndarray] | None = None
    model = None
    if target.model_dir is not None:
        if not Path(target.model_dir, "config.json").is_file() and not any(Path(target.model_dir).glob("*.safetensors")):
            raise FileNotFoundError(f"--target {target.spec}: not a Hugging Face model directory")
        model = store.model_from_dir(target.model_dir)
    elif store.available(target.version):
        model = store.model(target.version)
    else:
        skips.add(target.version, store.missing_reason(target.version), "target", n_tokens, len(rollouts))
    if model is not None and rollouts:
        target_logprobs = recompute(model, list(range(len(rollouts))), f"recomputing under {target.spec}")

    report: dict[str, Any] = {"run_dir": os.fspath(run_dir), "target": target.describe(),
                              "device": device, "clip": options.clip, "rollouts": len(rollouts),
                              "tokens": n_tokens}
    table = None
    if target_logprobs is not None and rollouts:
        sampled = np.concatenate([r.logprobs.astype(np.float64) for r in rollouts])
        recomputed = np.concatenate(target_logprobs)
        versions = np.concatenate([r.versions.astype(np.int64) for r in rollouts])
        lag = target.lag_reference - versions
        multi = np.concatenate([np.full(len(r.tokens), r.multi_version) for r in rollouts])
        position = np.concatenate([np.arange(len(r.tokens)) for r in rollouts])
        carried = np.concatenate([np.full(len(r.tokens), r.kv_carried) for r in rollouts])
        log_ratio = recomputed - sampled
        keep = ~np.isnan(sampled)  # an episode's environment tokens were not sampled: no logprob
        if not keep.all():
            log_ratio, lag, multi, position, carried = (a[keep] for a in (log_ratio, lag, multi, position, carried))
            sampled, recomputed, versions = sampled[keep], recomputed[keep], versions[keep]
        report.update(bucketed(log_ratio, lag, multi, position, carried, options.clip))
        if options.token_table:
            table = {"rollout_id": np.concatenate([np.full(len(r.tokens), r.rollout_id, np.int64)
                                                   for r in rollouts])[keep],
                     "position": position.astype(np.int32),
                     "token_id": np.concatenate([r.tokens for r in rollouts]).astype(np.int32)[keep],
                     "version": versions.astype(np.int32), "lag": lag.astype(np.int32),
                     "sampled_logprob": sampled.astype(np.float32),
                     "target_logprob": recomputed.astype(np.float32),
                     "log_ratio": log_ratio.astype(np.float32)}
    else:
        report.update({"overall": None, "by_lag": [], "by_span": [], "by_position": [], "by_kv_carried": []})

    # --- every token under its own version -----------------------------------------------------
    if options.verify_spans:
        reuse = target.version if target_logprobs is not None and target.model_dir is None else None
        report["verify_spans"] = _verify(rollouts, store, skips, options, recompute, target_logprobs, reuse)
        report["verify_spans_max_abs_diff"] = report["verify_spans"]["max_abs_diff"]
    else:
        report["verify_spans"] = None
        report["verify_spans_max_abs_diff"] = None

    report["per_step_lag"] = _per_step_lag(data)
    report["trainer_mismatch"] = _trainer_mismatch(data)
    report["skipped_versions"] = sorted(skips.versions)
    report["skipped"] = [skips.versions[v] for v in sorted(skips.versions)]
    seconds = timing["recompute_seconds"]
    report["timing"] = {**timing, "weights_load_seconds": store.load_seconds,
                        "tokens_per_s": timing["recompute_tokens"] / seconds if seconds > 0 else None}
    report["log"] = {"rollout_records": data.rollouts_seen, "rollouts_without_tokens": data.rollouts_without_tokens,
                     "corrupt_records": data.corrupt_records, "invalid_records": data.invalid_records,
                     "latest_version": data.latest_version, "kv_policies": sorted(data.kv_policies),
                     "base_model_dir": store.base_dir, "retained_versions": store.retained()}
    return report, table


def _verify(rollouts, store: VersionStore, skips: _Skips, options: Options, recompute,
            target_logprobs, reuse_version: int | None) -> dict[str, Any]:
    """Recompute each token under its own version; compare with the sampled logprob."""
    needed: dict[int, list[int]] = {}
    for i, r in enumerate(rollouts):
        for v in np.unique(r.versions):
            needed.setdefault(int(v), []).append(i)
    own = [np.full(len(r.tokens), np.nan) for r in rollouts]
    for version in sorted(needed):
        members = needed[version]
        if not store.available(version):
            tokens = sum(int((rollouts[i].versions == version).sum()) for i in members)
            skips.add(version, store.missing_reason(version), "verify_spans", tokens, len(members))
            continue
        if version == reuse_version:
            results = [target_logprobs[i] for i in members]
        else:
            results = recompute(store.model(version), members, f"verifying version {version}")
        for i, values in zip(members, results, strict=True):
            mask = rollouts[i].versions == version
            own[i][mask] = values[mask]

    diff_parts, keys = [], {"checked": [], "lag_key": []}
    first_failure = None
    tolerance = options.tolerance
    for i, r in enumerate(rollouts):
        diff = own[i] - r.logprobs.astype(np.float64)
        done = ~np.isnan(diff)
        exact = (not r.kv_carried) and r.serving_precision in EXACT_PRECISIONS
        if exact and first_failure is None:
            bad = np.flatnonzero(done & (np.abs(np.nan_to_num(diff)) > tolerance))
            if len(bad):
                p = int(bad[0])
                first_failure = {"rollout_id": r.rollout_id, "position": p, "version": int(r.versions[p]),
                                 "sampled_logprob": float(r.logprobs[p]), "recomputed_logprob": float(own[i][p]),
                                 "abs_diff": float(abs(diff[p]))}
        diff_parts.append(diff[done])
        keys["checked"].append(np.full(int(done.sum()), exact))
        keys["lag_key"].append((r.versions.astype(np.int64) - int(r.versions[0]))[done])
    diff = np.concatenate(diff_parts) if diff_parts else np.zeros(0)
    checked = np.concatenate(keys["checked"]) if diff_parts else np.zeros(0, bool)
    lag_key = np.concatenate(keys["lag_key"]) if diff_parts else np.zeros(0, np.int64)
    abs_diff = np.abs(diff)
    drift = ~checked
    checked_max = float(abs_diff[checked].max()) if checked.any() else None
    return {
        "tolerance": tolerance,
        "tokens": len(diff),
        "max_abs_diff": float(abs_diff.max()) if len(diff) else None,
        "checked_tokens": int(checked.sum()),
        "checked_max_abs_diff": checked_max,
        "passed": first_failure is None,
        "first_failure": first_failure,
        "unchecked_tokens": int(drift.sum()),
        "unchecked_max_abs_diff": float(abs_diff[drift].max()) if drift.any() else None,
        # versions since the rollout's first one: how far keys/values may have been carried
        "drift_by_lag": abs_diff_by(diff[drift], lag_key[drift], "lag") if drift.any() else [],
        "by_lag": abs_diff_by(diff, lag_key, "lag") if len(diff) else [],
    }


def _per_step_lag(data: Dataset) -> list[dict[str, Any]]:
    """Per consuming step s: the token lag (s - 1) - token version of the step's rollouts."""
    per_step: dict[int, list[np.ndarray]] = {}
    for r in data.rollouts:
        if r.consumed_step is not None:
            per_step.setdefault(r.consumed_step, []).append((r.consumed_step - 1) - r.sampled_versions().astype(np.int64))
    rows = []
    for step in sorted(per_step):
        lags = np.concatenate(per_step[step])
        rows.append({"step": step, "tokens": len(lags), "lag_mean": float(lags.mean()),
                     "lag_max": int(lags.max()), "histogram": lag_histogram(lags)})
    return rows


def _trainer_mismatch(data: Dataset) -> dict[str, Any]:
    """What the trainer measured at consumption: its logprobs minus the sampled ones, per step;
    the lag-0 rollouts (every token sampled by the version the step trained from) isolate the
    trainer-inference mismatch (serving precision, kernels, quantization on the way)."""
    rows = []
    for step in data.steps:
        means, maxes = step.log_ratio_mean, step.log_ratio_max_abs
        if means is None or maxes is None:
            rows.append({"step": step.step, "rollouts": len(step.rollout_ids), "recorded": False})
            continue
        lag0 = np.array([data.spans.get(rid) == (step.step - 1, step.step - 1) for rid in step.rollout_ids], bool)
        finite = np.isfinite(means)
        pick = lag0 & finite
        rows.append({
            "step": step.step, "rollouts": len(step.rollout_ids), "recorded": True,
            "lag0_rollouts": int(pick.sum()),
            "lag0_log_ratio_mean": float(means[pick].mean()) if pick.any() else None,
            "lag0_log_ratio_max_abs": float(maxes[pick].max()) if pick.any() else None,
            "log_ratio_mean": float(means[finite].mean()) if finite.any() else None,
            "log_ratio_max_abs": float(maxes[finite].max()) if finite.any() else None,
        })
    lag0 = [row["lag0_log_ratio_max_abs"] for row in rows if row.get("lag0_log_ratio_max_abs") is not None]
    return {"per_step": rows, "lag0_log_ratio_max_abs": max(lag0) if lag0 else None,
            "serving_precision": sorted(data.precisions), "logprobs_mode": sorted(data.logprobs_modes),
            "note": "lag-0 differences are the trainer-inference mismatch at the recorded serving "
                    "precision (quantization on the way, when used, shows here too)"}
