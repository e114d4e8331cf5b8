"""Off-policy statistics of per-token log-ratios, overall and bucketed.

For a token sampled from the behaviour policy q (the version that produced it) and scored under
the target policy p, the log-ratio is r = log p(token) - log q(token) and the importance ratio
w = exp(r). With tokens drawn from q, the estimators of KL(q || p) (Schulman's k1, k2, k3) are

    k1 = -r        k2 = r^2 / 2        k3 = (w - 1) - r

(k1 and k3 unbiased, k3 never negative; k2 biased but low-variance). The effective sample size
is reported as a fraction of the tokens, (sum w)^2 / (n sum w^2), and `clip_fraction` is the
share of tokens whose ratio exceeds the truncated-importance-sampling clip c. Percentiles are
nearest-rank, as in `inflight stats`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Final

import numpy as np

DEFAULT_CLIP: Final = 2.0
RATIO_PERCENTILES: Final = (1, 10, 50, 90, 99)
POSITION_EDGES: Final = (0, 1, 4, 16, 64, 256, 1024)  # completion-position buckets: [edge, next)
_MAX_LOG_RATIO: Final = 700.0  # exp() stays finite in float64


def _nearest_rank(sorted_values: np.ndarray, q: float) -> float:
    n = len(sorted_values)
    rank = max(1, int(np.ceil(q / 100.0 * n)))
    return float(sorted_values[rank - 1])


def summarize(log_ratio: np.ndarray, clip: float = DEFAULT_CLIP) -> dict[str, Any]:
    """Statistics of one bucket of per-token log-ratios (float64)."""
    r = np.asarray(log_ratio, dtype=np.float64)
    n = len(r)
    out: dict[str, Any] = {"tokens": int(n)}
    if n == 0:
        for key in ("ratio_mean", *(f"ratio_p{q}" for q in RATIO_PERCENTILES), "kl_k1", "kl_k2",
                    "kl_k3", "ess_fraction", "clip_fraction", "log_ratio_mean", "log_ratio_max_abs"):
            out[key] = None
        return out
    w = np.exp(np.clip(r, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))
    ordered = np.sort(w)
    out["ratio_mean"] = float(w.mean())
    for q in RATIO_PERCENTILES:
        out[f"ratio_p{q}"] = _nearest_rank(ordered, q)
    out["kl_k1"] = float(-r.mean())
    out["kl_k2"] = float(0.5 * (r * r).mean())
    out["kl_k3"] = float(np.maximum((w - 1.0) - r, 0.0).mean())
    scaled = np.exp(r - r.max())  # the ESS is scale-free: normalised ratios cannot overflow
    out["ess_fraction"] = float(scaled.sum() ** 2 / (n * float((scaled * scaled).sum())))
    out["clip_fraction"] = float((w > clip).mean())
    out["log_ratio_mean"] = float(r.mean())
    out["log_ratio_max_abs"] = float(np.abs(r).max())
    return out


def position_label(low: int, high: int | None) -> str:
    if high is None:
        return f"{low}+"
    return str(low) if high - low == 1 else f"{low}-{high - 1}"


def bucketed(log_ratio: np.ndarray, lag: np.ndarray, multi: np.ndarray, position: np.ndarray,
             carried: np.ndarray, clip: float = DEFAULT_CLIP) -> dict[str, Any]:
    """`overall`, `by_lag`, `by_span`, `by_position`, `by_kv_carried` for aligned per-token
    arrays: log-ratio, lag (int), rollout spans several versions (bool), position in the
    completion (int), keys/values carried across a swap (bool)."""
    out: dict[str, Any] = {"overall": summarize(log_ratio, clip)}
    out["by_lag"] = [{"lag": int(value), **summarize(log_ratio[lag == value], clip)}
                     for value in np.unique(lag)]
    out["by_span"] = [{"span": name, **summarize(log_ratio[mask], clip)}
                      for name, mask in (("single", ~multi), ("multi", multi)) if mask.any()]
    edges = list(POSITION_EDGES)
    by_position = []
    for i, low in enumerate(edges):
        high = edges[i + 1] if i + 1 < len(edges) else None
        mask = (position >= low) & ((position < high) if high is not None else True)
        if np.any(mask):
            by_position.append({"position": position_label(low, high), "position_min": low,
                                **summarize(log_ratio[mask], clip)})
    out["by_position"] = by_position
    out["by_kv_carried"] = [{"kv_carried": name, **summarize(log_ratio[mask], clip)}
                            for name, mask in ((False, ~carried), (True, carried)) if mask.any()]
    return out


def lag_histogram(lags: Iterable[int]) -> dict[str, int]:
    values, counts = np.unique(np.fromiter(lags, dtype=np.int64), return_counts=True)
    return {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)}


def abs_diff_by(diff: np.ndarray, keys: np.ndarray, name: str) -> list[dict[str, Any]]:
    """Per distinct key: tokens, max and mean |diff| (verify-spans drift tables)."""
    rows = []
    for value in np.unique(keys):
        d = np.abs(diff[keys == value])
        rows.append({name: int(value), "tokens": len(d), "max_abs_diff": float(d.max()),
                     "mean_abs_diff": float(d.mean())})
    return rows
