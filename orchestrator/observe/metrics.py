"""Prometheus metrics of a run (prometheus_client, one registry per run).

The rollout counters are incremented from the records the run writes (never from anything
else), so at a quiescent moment they equal the log's own counts.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from replay.records import (
    DISCARD_STALE,
    DROP_STALE,
    ActivationRecord,
    ConsumptionRecord,
    DiscardRecord,
    Dropped,
    Errored,
    RolloutRecord,
)

LAG_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32)
SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class RunMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.inflight = Gauge("inflight_rollouts_in_flight", "Rollouts dispatched and not yet ended", registry=r)
        self.rollouts = Counter("inflight_rollouts", "Terminal rollout records by status and reason",
                                ["status", "reason"], registry=r)
        self.discarded = Counter("inflight_discarded_rollouts", "Completed rollouts no step consumed, by reason",
                                 ["reason"], registry=r)
        self.consumed = Counter("inflight_consumed_rollouts", "Rollouts consumed by trainer steps", registry=r)
        self.staleness = Histogram("inflight_staleness_steps", "(step - 1) - dispatched version of consumed samples",
                                   buckets=LAG_BUCKETS, registry=r)
        self.in_flight_lag = Histogram("inflight_in_flight_lag_steps", "Last minus first version of a consumed "
                                       "sample's tokens", buckets=LAG_BUCKETS, registry=r)
        self.engines = Gauge("inflight_engines", "Engines of the fleet by state (joining, serving, fenced, "
                             "draining, left, lost, refused)", ["state"], registry=r)
        self.live_version = Gauge("inflight_live_version", "The policy version every serving engine runs", registry=r)
        self.activation = Histogram("inflight_activation_seconds", "Activation time per engine by phase",
                                    ["phase"], buckets=SECONDS_BUCKETS, registry=r)
        self.activations = Counter("inflight_activations", "Activations by outcome", ["outcome"], registry=r)
        self.tokens_per_s = Gauge("inflight_tokens_per_second", "Completion tokens per second over the last step",
                                  registry=r)
        self.tokens = Counter("inflight_completion_tokens", "Completion tokens of completed rollouts", registry=r)
        self.dropped_stale_tokens = Counter(
            "inflight_dropped_stale_tokens", "Completion tokens of rollouts dropped in flight or discarded for "
            "staleness (what they had generated)", registry=r)
        # Completed rollouts not yet consumed or discarded -> their completion tokens: what a stale
        # discard (which names only rollout ids) threw away. Entries leave with their rollout.
        self._unsettled_tokens: dict[int, int] = {}
        self._rollout_children: dict[tuple[str, str], object] = {}  # (status, reason) -> its counter
        self.loop_lag = Gauge("inflight_event_loop_lag_seconds", "How late the event loop woke a 0.25 s sleep",
                              registry=r)
        self.trainer_step = Gauge("inflight_trainer_step", "Trainer optimizer steps done", registry=r)
        self.reward = Gauge("inflight_reward_mean", "Mean reward of the last step's batch", registry=r)
        self.reward_component = Gauge("inflight_reward_component_mean", "Mean of each reward component over the "
                                      "last step's batch", ["component"], registry=r)
        self.eval_pass = Gauge("inflight_eval_pass_at_k", "pass@k of the last held-out evaluation",
                               ["task", "k"], registry=r)
        self.eval_mean = Gauge("inflight_eval_mean_at_k", "mean@k (mean reward) of the last held-out evaluation",
                               ["task", "k"], registry=r)
        self._tokens_mark = (time.monotonic(), 0)

    def on_record(self, record) -> None:
        """Called for every record the run writes."""
        if isinstance(record, RolloutRecord):
            status = record.status
            name = record.status_name
            reason = status.reason if isinstance(status, Dropped) else status.kind if isinstance(status, Errored) else ""
            # One child a (status, reason), looked up once: `labels` takes a lock and builds
            # a key on every call, and this runs for every record the run writes.
            child = self._rollout_children.get((name, reason))
            if child is None:
                child = self._rollout_children[(name, reason)] = self.rollouts.labels(name, reason)
            child.inc()
            if name == "completed":
                tokens = record.num_completion_tokens
                self.tokens.inc(tokens)
                self._unsettled_tokens[record.rollout_id] = tokens
            elif reason == DROP_STALE and isinstance(status, Dropped):
                self.dropped_stale_tokens.inc(record.num_completion_tokens)
        elif isinstance(record, ActivationRecord):
            self.activations.labels(record.outcome).inc()
            for engine in record.engines:
                self.activation.labels("transfer").observe(engine.transfer_s)
                self.activation.labels("pause").observe(engine.pause_s)
        elif isinstance(record, DiscardRecord):
            self.discarded.labels(record.reason).inc(len(record.rollout_ids))
            tokens = sum(self._unsettled_tokens.pop(rid, 0) for rid in record.rollout_ids)
            if record.reason == DISCARD_STALE:
                self.dropped_stale_tokens.inc(tokens)
        elif isinstance(record, ConsumptionRecord):
            for rid in record.rollout_ids:
                self._unsettled_tokens.pop(rid, None)

    def on_step(self, step: int, staleness: list[int], in_flight_lag: list[int], reward: float | None,
                components: dict[str, float] | None = None) -> None:
        self.trainer_step.set(step)
        for name, value in (components or {}).items():
            self.reward_component.labels(name).set(value)
        self.consumed.inc(len(staleness))
        for s in staleness:
            self.staleness.observe(s)
        for lag in in_flight_lag:
            self.in_flight_lag.observe(lag)
        if reward is not None:
            self.reward.set(reward)
        now, total = time.monotonic(), self.tokens._value.get()
        then, before = self._tokens_mark
        if now > then:
            self.tokens_per_s.set((total - before) / (now - then))
        self._tokens_mark = (now, total)

    def on_eval(self, record) -> None:
        for gauge, value in ((self.eval_pass, record.pass_at_k), (self.eval_mean, record.mean_at_k)):
            if value is not None:
                gauge.labels(record.task, str(record.k)).set(value)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_s._value.get()

    def render(self) -> bytes:
        return generate_latest(self.registry)
