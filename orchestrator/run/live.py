"""What the run's HTTP server answers about the live run: /stats (the live log, with the fleet's
history), /metrics and /healthz (orchestrator/observe/http.py serves them)."""

from __future__ import annotations


def live_stats(run, filters) -> dict | None:
    """/stats over the live log; None (503) while the run is starting."""
    recorder = getattr(run, "recorder", None)
    if recorder is None:
        return None
    stats = recorder.stats(filters)
    fleet = getattr(run, "fleet", None)
    if fleet is not None and stats is not None:  # what `inflight stats` reads from RUN_DIR/fleet.jsonl
        from replay.query.fromlog import fleet_history

        stats["fleet"] = fleet_history(run.run_dir) or []
    return stats


def live_metrics(run) -> bytes | None:
    metrics = getattr(run, "metrics", None)
    return metrics.render() if metrics is not None else None


def run_health(run) -> dict:
    """/healthz: the run's state; "ok": false with "degraded" saying why it cannot progress."""
    scheduler = getattr(run, "scheduler", None)
    fleet = getattr(run, "fleet", None)
    failing = getattr(getattr(run, "loop", None), "activation_failing", None)
    health = {"ok": failing is None, "run_id": getattr(run, "run_id", None), "state": run.state,
              "step": scheduler.done_steps if scheduler else None,
              "live_version": fleet.live_version if fleet else None,
              "serving": list(fleet.coordinator.serving) if fleet else [],
              "in_flight": scheduler.inflight if scheduler else None}
    if failing is not None:
        health["degraded"] = f"activation failing: {failing}"
    note = run.loop.guard.note() if getattr(run, "loop", None) is not None else None
    if note is not None:
        health["ok"], health["degraded"] = False, f"rollouts failing: {note}"
    keeper = getattr(getattr(run, "loop", None), "keeper", None)
    if fleet is not None:
        health["engines"] = fleet.member_counts()
    if keeper is not None and keeper.paused_why is not None:
        health["ok"], health["degraded"] = False, keeper.paused_why
    return health
