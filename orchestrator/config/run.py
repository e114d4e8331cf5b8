"""Configuration types (msgspec Structs), loaded from TOML. A bad field names itself."""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec

from orchestrator.config.cluster import ClusterConfig
from orchestrator.config.engine import EngineConfig  # noqa: F401 - re-exported (config.run.EngineConfig)
from orchestrator.config.fleet import FleetConfig
from orchestrator.config.sampling import check_sampling
from orchestrator.config.task import EvalConfig, TaskConfig
from orchestrator.config.trainer import LoraConfig, TrainerConfig
from orchestrator.errors import ConfigError
from replay.records import SamplingSettings


@dataclass(frozen=True)
class PhaseTimeouts:
    """Each activation phase's limit, as the (pure) coordinator takes them."""

    stage_s: float = 120.0
    drain_s: float = 30.0
    pause_s: float = 30.0
    swap_s: float = 60.0  # swap + fence cache + set version, per activation
    resume_s: float = 30.0
    rejoin_s: float = 180.0


class ActivationConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a staged version becomes live on the fleet (docs/activation.md)."""

    # pause_swap: copy staged weights in during a pause; double_buffer: flip to a second,
    # engine-ready copy during a pause; pause_free: that flip between two engine steps.
    strategy: Literal["pause_swap", "double_buffer", "pause_free"] = "pause_swap"
    # What happens to requests in flight at the swap.
    kv_policy: Literal["recompute", "keep", "drain", "abort"] = "recompute"
    stage_s: float = 120.0
    drain_s: float = 30.0
    pause_s: float = 30.0
    swap_s: float = 60.0
    resume_s: float = 30.0
    rejoin_s: float = 180.0
    # Activations of published versions that fail in a row before the run stops with the cause
    # (a failure that repeats is not transient; /healthz reports degraded meanwhile).
    max_failures: int = 5

    def validate(self) -> ActivationConfig:
        for name in ("stage_s", "drain_s", "pause_s", "swap_s", "resume_s", "rejoin_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"activation.{name}", f"must be > 0, got {getattr(self, name)}")
        if self.max_failures < 1:
            raise ConfigError("activation.max_failures", f"must be >= 1, got {self.max_failures}")
        if self.strategy == "pause_free" and self.kv_policy == "recompute":
            # Recomputing in-flight keys/values needs the engine paused; the flip has no pause.
            raise ConfigError("activation.kv_policy",
                              "recompute needs a pause; with strategy pause_free use keep, drain or abort")
        return self

    def timeouts(self) -> PhaseTimeouts:
        return PhaseTimeouts(stage_s=self.stage_s, drain_s=self.drain_s, pause_s=self.pause_s,
                             swap_s=self.swap_s, resume_s=self.resume_s, rejoin_s=self.rejoin_s)


class EngineOverride(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One `[[engines]]` entry: overrides of `[engine]` for one engine (e.g. its URL or port)."""

    id: str | None = None  # engine id in records and metrics; default "engine-<index>"
    url: str | None = None
    port: int | None = None
    kind: Literal["inproc", "server"] | None = None
    model: str | None = None
    seed: int | None = None
    max_num_seqs: int | None = None


class SchedulerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How rollouts are admitted, grouped, bounded in staleness and handed to the trainer."""

    # GRPO: every prompt is sampled `group_size` times; a trainer step takes `batch_groups` groups.
    group_size: int = 8
    batch_groups: int = 8
    # No sample reaches the trainer more than this many versions behind it: a sample consumed
    # by step s has staleness (s - 1) - dispatched_version <= max_off_policy_steps.
    max_off_policy_steps: int = 4
    # Rollouts in flight on all engines together (admission also keeps dispatched-but-not-
    # consumed rollouts within (max_off_policy_steps + 1) x batch size).
    max_inflight: int = 256
    # An errored rollout is replaced in its group this many times, then the group is dropped.
    max_retries: int = 2
    # async: sample while the trainer steps; sync: each step waits for rollouts of the newest version.
    mode: Literal["async", "sync"] = "async"
    # async: when groups are admitted. just_in_time (the default): only when waiting for the next
    # version would make the trainer wait (paced by the trainer's step time and the generation
    # round it observes), so samples come from the newest version that can still be ready in
    # time; when generation is the bottleneck that is the bound, as eager. eager: at once, up to
    # the bound above, so when the trainer is the bottleneck every sample is as stale as the bound
    # allows. The trade-off: a generation round longer than the ones observed so far can make the
    # trainer wait (at most about one round), which eager's buffer of (max_off_policy_steps + 1)
    # batches would have hidden, at the price of staler samples. Measured (docs/architecture.md,
    # "Admission"): fewer steps and less time to reward 0.9 on the trainer-bound `small` workload
    # (three seeds), the same on the generation-bound `tiny` one.
    admission: Literal["just_in_time", "eager"] = "just_in_time"
    # What the staleness bound measures. dispatch: the version a rollout was dispatched at (every
    # token within the bound). majority: the newest version under which more than half of its
    # tokens were sampled: a long rollout that spans versions is kept more often (fewer stale
    # drops), but its earliest tokens may be older than the bound, by its in-flight lag.
    staleness_by: Literal["dispatch", "majority"] = "dispatch"

    @property
    def batch_size(self) -> int:
        return self.group_size * self.batch_groups

    def validate(self) -> SchedulerConfig:
        for name in ("group_size", "batch_groups", "max_inflight"):
            if getattr(self, name) < 1:
                raise ConfigError(f"scheduler.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ConfigError("scheduler.group_size", "GRPO normalises rewards within a group: must be >= 2")
        if self.max_off_policy_steps < 0:
            raise ConfigError("scheduler.max_off_policy_steps", f"must be >= 0, got {self.max_off_policy_steps}")
        if self.max_retries < 0:
            raise ConfigError("scheduler.max_retries", f"must be >= 0, got {self.max_retries}")
        if self.max_inflight < self.group_size:
            raise ConfigError("scheduler.max_inflight",
                              f"must hold at least one group ({self.group_size}), got {self.max_inflight}")
        for name, allowed in (("mode", ("async", "sync")), ("admission", ("just_in_time", "eager")),
                              ("staleness_by", ("dispatch", "majority"))):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"scheduler.{name}", f"must be one of {list(allowed)}, got {getattr(self, name)!r}")
        return self


class TransportConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How each new version travels from the trainer to the engines."""

    # The filesystem transport (safetensors + COMPLETE marker under RUN_DIR/weights) is the one
    # `inflight run` drives; the engines stage from it off-pause.
    name: Literal["filesystem"] = "filesystem"
    # Versions retained on disk (replay analysis reads them).
    keep_last: int = 8
    timeout_s: float = 120.0

    def validate(self) -> TransportConfig:
        if self.keep_last < 1:
            raise ConfigError("transport.keep_last", f"must be >= 1, got {self.keep_last}")
        if not self.timeout_s > 0:
            raise ConfigError("transport.timeout_s", f"must be > 0, got {self.timeout_s}")
        return self


class WandbConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    project: str
    mode: Literal["online", "offline", "disabled"] = "offline"
    name: str | None = None  # the run's display name; default: W&B's


class RunSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The run as a whole."""

    # "{time}" becomes the start time (runs/20261130-142501), so every run gets its own directory.
    dir: str = "runs/{time}"
    max_steps: int = 60
    seed: int = 0
    # Model preset built when `engine.model` is missing (see `inflight model init`).
    model_preset: Literal["tiny", "tiny-rl", "tiny-lora", "small", "small-rl"] = "tiny-rl"
    # Replay log durability: fsync when this many records wait, or when the oldest is this old.
    fsync_every_records: int = 256
    fsync_every_ms: float = 200.0
    # SIGINT/SIGTERM: in-flight rollouts get a terminal record within this time.
    shutdown_grace_s: float = 30.0
    # After the run ends (log flushed, trainer and engines stopped), keep answering /stats and
    # /metrics this long (0: exit at once); SIGINT/SIGTERM ends the wait.
    linger_s: float = 0.0
    # auto: a live rich display on a terminal, plain lines otherwise; plain; none.
    progress: Literal["auto", "rich", "plain", "none"] = "auto"
    # TensorBoard event files in RUN_DIR/tensorboard.
    tensorboard: bool = True
    # Weights & Biases (older spelling of `wandb`): a project name turns it on.
    wandb_project: str | None = None
    wandb_mode: Literal["online", "offline"] = "offline"

    # Weights & Biases: `wandb = {project = "...", mode = "offline"}` turns it on; "offline" needs no
    # network (the run lands in RUN_DIR/wandb; `wandb sync` uploads it later).
    wandb: WandbConfig | None = None
    # A run that cannot progress stops (exit 2, one line): no trainer step for stall_s while the
    # trainer holds no batch; the line names the error kind that ended at least max_error_share of
    # the last error_window rollouts (completed or errored), with an example, or what it waited on.
    stall_s: float = 600.0
    max_error_share: float = 0.9
    error_window: int = 256
    # ... and sooner, after all_errored_s without a step, when the last rollouts, a batch's worth
    # (scheduler.batch_size) or error_window if fewer, all errored by the user's code (none
    # completed: no batch can fill). Set it to stall_s for a reward whose outages are long and
    # expected (a remote judge): the run then waits them out.
    all_errored_s: float = 60.0

    def wandb_settings(self) -> WandbConfig | None:
        if self.wandb is not None:
            return self.wandb
        if self.wandb_project:
            return WandbConfig(project=self.wandb_project, mode=self.wandb_mode)
        return None

    def validate(self) -> RunSection:
        if self.max_steps < 1:
            raise ConfigError("run.max_steps", f"must be >= 1, got {self.max_steps}")
        if self.fsync_every_records < 1:
            raise ConfigError("run.fsync_every_records", f"must be >= 1, got {self.fsync_every_records}")
        for name in ("fsync_every_ms", "shutdown_grace_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"run.{name}", f"must be > 0, got {getattr(self, name)}")
        if self.linger_s < 0:
            raise ConfigError("run.linger_s", f"must be >= 0, got {self.linger_s}")
        for name in ("stall_s", "all_errored_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"run.{name}", f"must be > 0, got {getattr(self, name)}")
        if not 0 < self.max_error_share <= 1:
            raise ConfigError("run.max_error_share", f"must be in (0, 1], got {self.max_error_share}")
        if self.error_window < 1:
            raise ConfigError("run.error_window", f"must be >= 1, got {self.error_window}")
        return self


class HttpConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The live query server: GET /stats, /metrics, /healthz."""

    enabled: bool = True
    host: str = "127.0.0.1"  # loopback unless you mean it
    port: int = 0  # 0 picks a free port; the address is written to RUN_DIR/http.json

    def validate(self) -> HttpConfig:
        if not 0 <= self.port <= 65535:
            raise ConfigError("http.port", f"must be in [0, 65535], got {self.port}")
        return self


# The swap worker extension: what activation needs inside every engine worker. Set by default so
# that a user never has to know it exists.
SWAP_EXTENSION = "transports.swap.SwapWorkerExtension"


class RunConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One TOML file: every table optional. See examples/default.toml for every knob."""

    engine: EngineConfig = EngineConfig(model="models/tiny-rl", max_model_len=512, max_num_seqs=128)
    # An engine count, or one `[[engines]]` table per engine with its overrides.
    engines: int | list[EngineOverride] = 1
    activation: ActivationConfig = ActivationConfig()
    sampling: SamplingSettings = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens=16)
    scheduler: SchedulerConfig = SchedulerConfig()
    trainer: TrainerConfig = TrainerConfig()
    task: TaskConfig = TaskConfig()
    transport: TransportConfig = TransportConfig()
    run: RunSection = RunSection()
    http: HttpConfig = HttpConfig()
    eval: EvalConfig = EvalConfig()
    # A run over the hosts of a Ray cluster (docs/cluster.md); absent: one host.
    cluster: ClusterConfig | None = None
    # Engines that join, leave and are replaced mid-run (docs/fleet.md).
    fleet: FleetConfig = FleetConfig()

    def validate(self) -> RunConfig:
        if isinstance(self.engines, int) and self.engines < 1:
            raise ConfigError("engines", f"must be >= 1, got {self.engines}")
        if isinstance(self.engines, list) and not self.engines:
            raise ConfigError("engines", "needs at least one [[engines]] table")
        self.engine.validate()
        check_sampling(self.sampling)
        check_training_sampling(self.sampling)
        for section in (self.activation, self.scheduler, self.trainer, self.task, self.transport,
                        self.run, self.http, self.eval, self.fleet):
            section.validate()
        if self.eval.every_steps:
            self.eval.task_config(self.task)  # the eval task's fields must be valid too
        check_publish_cadence(self.trainer, self.scheduler)
        check_lora(self)
        if self.cluster is not None:
            check_cluster(self)
        ids = [engine_id for engine_id, _ in self.engine_configs()]
        if len(set(ids)) != len(ids):
            raise ConfigError("engines", f"engine ids must be unique, got {ids}")
        return self

    def engine_configs(self) -> list[tuple[str, EngineConfig]]:
        """(engine id, its full config) per engine: `[engine]` with each `[[engines]]` override,
        and the swap worker extension that activation needs."""
        base = self.engine
        if base.worker_extension_cls is None:
            base = msgspec.structs.replace(base, worker_extension_cls=SWAP_EXTENSION)
        if base.shutdown_timeout_s is None:  # a SIGTERM drains like `inflight fleet drain`
            base = msgspec.structs.replace(base, shutdown_timeout_s=math.ceil(self.fleet.drain_s))
        lora = self.trainer.lora
        if lora is not None:  # every version is an adapter the engines load natively
            base = msgspec.structs.replace(base, enable_lora=True, max_lora_rank=lora.engine_rank,
                                           max_loras=lora.resident(self.scheduler.max_off_policy_steps))
        if self.cluster is not None:  # every engine a server process that Ray places on a node
            base = msgspec.structs.replace(base, kind="server")
            return [(f"engine-{i}", msgspec.structs.replace(base, seed=base.seed + i))
                    for i in range(self.cluster.engines.count)]
        if isinstance(self.engines, int):
            return [(f"engine-{i}", msgspec.structs.replace(base, seed=base.seed + i)) for i in range(self.engines)]
        out = []
        for i, override in enumerate(self.engines):
            changes = {k: v for k, v in msgspec.structs.asdict(override).items() if v is not None and k != "id"}
            try:
                config = msgspec.structs.replace(base, **changes).validate()
            except ConfigError as exc:
                raise ConfigError(f"engines[{i}].{exc.field.removeprefix('engine.')}", exc.reason) from None
            out.append((override.id or f"engine-{i}", config))
        return out


def check_training_sampling(s: SamplingSettings) -> None:
    """What a run can train on, beyond the ranges every sampling setting has (`check_sampling`;
    the replay record's type keeps accepting these, so that old logs still read)."""
    if not s.temperature > 0:
        raise ConfigError("sampling.temperature",
                          f"must be > 0 to train, got {s.temperature}: greedy decoding (0) is refused for "
                          "training (it samples from no distribution, and the trainer's logits / temperature "
                          "would divide by zero)")
    if s.min_tokens > 0:
        raise ConfigError("sampling.min_tokens",
                          f"must be 0 to train, got {s.min_tokens}: it forbids end-of-sequence before that "
                          "many tokens, which truncates the distribution (as top_k does) in a way the "
                          "trainer does not replicate")


def check_cluster(config: RunConfig) -> None:
    """What `[cluster]` decides itself, and what it does not carry yet, refused by name."""
    config.cluster.validate()
    if config.engines != 1:
        raise ConfigError("engines", "with [cluster] the engines are placed by Ray: set cluster.engines.count "
                                     "(and [engine] for their settings), not `engines`")
    if config.engine.url is not None:
        raise ConfigError("engine.url", "with [cluster] every engine is a server that Ray starts on its node; "
                                        "an engine attached by URL is not placed")
    if config.trainer.lora is not None:
        raise ConfigError("trainer.lora", "LoRA adapters are not carried to engines on other hosts yet: run "
                                          "[trainer.lora] on one host (without [cluster])")
    if not config.http.enabled:
        raise ConfigError("http.enabled", "with [cluster] the engines pull each version from the run's HTTP "
                                          "server: http.enabled must be true")
    if config.cluster.trainer.nodes > 1:
        tc = config.trainer
        if tc.torchrun_args:
            raise ConfigError("trainer.torchrun_args", "with cluster.trainer.nodes > 1 the rendezvous is the "
                                                       "cluster's (nodes, ranks, address): leave torchrun_args out")
        if tc.checkpoint_every > 1:
            raise ConfigError("trainer.checkpoint_every", "> 1 needs one trainer process; cluster.trainer.nodes > 1 "
                                                          "runs torchrun, whose ranks checkpoint every version")
        if tc.checkpoint_background:
            raise ConfigError("trainer.checkpoint_background", "needs one trainer process; cluster.trainer.nodes > 1 "
                                                               "runs torchrun, whose ranks gather each checkpoint")


def check_lora(config: RunConfig) -> None:
    """A LoRA run's versions are adapters that requests name: nothing is swapped, so the
    strategies that prepare a second copy of the model do not apply."""
    if config.trainer.lora is None:
        return
    if config.activation.strategy != "pause_swap":
        raise ConfigError("activation.strategy",
                          f"{config.activation.strategy!r} swaps full weights; with trainer.lora each version is an "
                          "adapter loaded beside the serving ones and activated with no pause: leave the default")
    if config.activation.kv_policy != "recompute":
        raise ConfigError("activation.kv_policy",
                          f"{config.activation.kv_policy!r} does not apply with trainer.lora: a request runs on the "
                          "adapter it named from its first token to its last (nothing is swapped under it): leave "
                          "the default")
    # What [trainer.lora] sets on every engine: a value of one's own would be silently replaced.
    defaults = EngineConfig()
    for name in ("max_lora_rank", "max_loras"):
        if getattr(config.engine, name) != getattr(defaults, name):
            raise ConfigError(f"engine.{name}", f"set from [trainer.lora] (trainer.lora.rank, trainer.lora.max_loras): "
                                                f"remove it from [engine]")


def check_publish_cadence(trainer: TrainerConfig, scheduler: SchedulerConfig) -> None:
    """Between two published versions the trainer takes `publish_every` steps on samples of
    the same live version, so its last step before the next publish trains on samples
    publish_every - 1 versions old: beyond `max_off_policy_steps` no such sample may be
    consumed, and the run would wait forever."""
    every, bound = trainer.publish_every, scheduler.max_off_policy_steps
    if every - 1 > bound:
        raise ConfigError("trainer.publish_every",
                          f"{every} needs samples {every - 1} versions old before the next version is "
                          f"published, beyond scheduler.max_off_policy_steps = {bound}: the run would stall "
                          f"after step {bound + 1}; use publish_every <= {bound + 1} or raise max_off_policy_steps")


def load_config(path: str | Path) -> RunConfig:
    """Read and validate a TOML config; errors name the field, e.g. `activation.kv_policy`."""
    data = _load_toml(Path(path))
    # The sampling type is the replay record's, which tolerates unknown fields (old readers of
    # new logs); a config file must not: a misspelt key would be ignored silently.
    sampling = data.get("sampling")
    if isinstance(sampling, dict):
        unknown = sorted(set(sampling) - set(SamplingSettings.__struct_fields__))
        if unknown:
            raise ConfigError(f"sampling.{unknown[0]}", f"unknown key {unknown[0]!r}")
    return convert(data, RunConfig, "").validate()


def default_config() -> RunConfig:
    """The embedded default: one CPU engine on the tiny-rl model, the digits task, a trainer."""
    return RunConfig().validate()


def _load_toml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(str(path), "config file does not exist")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None


def convert(data: object, type_: type, where: str):
    """msgspec conversion whose error names the field path, e.g. `engine.max_num_seqs`."""
    try:
        return msgspec.convert(data, type_, strict=True)
    except msgspec.ValidationError as exc:
        # msgspec says e.g. "Expected `int`, got `str` - at `$.engine.max_num_seqs`".
        message = str(exc)
        field = where
        unknown = re.search(r"unknown field `([^`]+)`", message)
        if " - at `$" in message:
            message, _, path = message.partition(" - at `$")
            field = (where + path.rstrip("`")).strip(".") if where else path.rstrip("`").lstrip(".")
        if unknown:
            field = f"{field}.{unknown.group(1)}" if field else unknown.group(1)
            message = f"unknown key {unknown.group(1)!r}"
        raise ConfigError(field or "config", message) from None


__all__ = ["ActivationConfig", "LoraConfig", "ConfigError", "EngineConfig", "EvalConfig", "WandbConfig", "EngineOverride", "HttpConfig", "RunConfig",
           "RunSection", "SamplingSettings", "SchedulerConfig", "TaskConfig", "TrainerConfig",
           "TransportConfig", "convert", "default_config", "load_config"]
