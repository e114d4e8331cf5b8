"""Setting up and tearing down one `inflight run`: run directory, model, replay log, trainer,
engines, fleet, scheduler, HTTP, progress; `loop.RunLoop` does the running.

RUN_DIR holds:
    config.json          the resolved configuration (every default written out)
    replay/              the replay log (inflight stats / export read it)
    dispatch.journal     every dispatch, durable before its request is sent (resume.py)
    weights/vNNNNNNNN/   the retained versions (filesystem transport, keep_last)
    trainer/step-*/      trainer checkpoints (model, optimizer, the step's consumption)
    orchestrator.jsonl   the structured log (JSON lines); trainer.log, engine logs
    tensorboard/         TensorBoard event files
    http.json            the live query server's address
    chat_template.jinja  the task's own template (task.chat_template as a path), for export-model
    run.lock             held (flock) by the process that runs there: one run a directory at a time
"""

from __future__ import annotations

import functools
import os
import signal
import time
import uuid
from pathlib import Path

import anyio
import msgspec

from orchestrator.config.run import RunConfig
from orchestrator.errors import ConfigError, InflightError
from orchestrator.observe.logging import get_logger
from orchestrator.observe.progress import Progress, ProgressState, summary
from orchestrator.run.live import run_health
from orchestrator.run.preflight import (check_model_paths, finished_steps, hold_run_dir,
                                        refuse_a_run_dir_holding_a_run, release_run_dir)
from orchestrator.run.restore import restore
from orchestrator.run.startup import StartupClock
from orchestrator.scheduling import scheduler as sch
from transports.engine_signals import ENGINE_CHILD_ENV

log = get_logger(__name__)
CONFIG_FILE = "config.json"


class RunFailed(InflightError):
    """The run could not go on (the trainer failed, every engine is fenced)."""


def resolve_config(config: RunConfig | None, run_dir: Path, resume: bool) -> RunConfig:
    """On --resume the run's own config.json is the truth (a config file given as well must be
    the same run's: refused, naming the keys that differ); otherwise the given config (or the
    embedded default)."""
    from orchestrator.run.preflight import check_resume_config, refuse_a_run_dir_in_use

    stored = run_dir / CONFIG_FILE
    if resume:
        if not stored.exists():
            raise ConfigError("--resume", f"{run_dir} holds no run to resume (no {CONFIG_FILE})")
        saved = msgspec.json.decode(stored.read_bytes(), type=RunConfig).validate()
        check_resume_config(config, saved, run_dir)
        return saved
    if stored.exists():
        refuse_a_run_dir_in_use(run_dir)
        refuse_a_run_dir_holding_a_run(run_dir)  # else the run before stopped in its set-up: this one takes over
    return config or RunConfig().validate()


def run_sampling(config: RunConfig):
    """The sampling every rollout uses, and the logprobs mode that makes the engine's sampled
    logprobs the distribution the trainer's ratio is computed on."""
    s = config.sampling
    if s.top_p < 1.0 or s.top_k not in (0, -1) or getattr(s, "min_p", 0.0):
        raise ConfigError("sampling.top_p", "inflight run trains on temperature-scaled logprobs only: "
                                            "top_p, top_k and min_p truncate the distribution, which "
                                            "the trainer does not replicate (leave them off)")
    plain = s.temperature == 1.0
    return s, ("raw_logprobs" if plain else "processed_logprobs")


class Run:
    def __init__(self, config: RunConfig | None, run_dir: str | Path | None, *, resume: bool = False,
                 max_steps: int | None = None) -> None:
        self.startup = StartupClock()
        base = config or RunConfig().validate()
        self.run_dir = Path(run_dir or base.run.dir.replace("{time}", time.strftime("%Y%m%d-%H%M%S"))).resolve()
        self.resume = resume
        self.config = resolve_config(config, self.run_dir, resume)
        self.max_steps = max_steps or self.config.run.max_steps
        if self.max_steps < 1:
            raise ConfigError("--max-steps", f"must be >= 1, got {self.max_steps}")
        check_model_paths(self.config)
        self.sampling, self.logprobs_mode = run_sampling(self.config)
        self.http = None
        self.http_socket = None
        self.cluster = None  # orchestrator.run.cluster.ClusterSide with [cluster]
        self.progress = Progress(ProgressState(self.max_steps), self.config.run.progress)
        self.tracking = None

    # -- the whole run -------------------------------------------------------------------------
    async def main(self) -> int:
        if self.resume and self._already_finished():
            return 0
        self.run_dir.mkdir(parents=True, exist_ok=True)
        lock = hold_run_dir(self.run_dir)  # one process a directory, from before its config is written
        try:
            return await self._main_holding_the_directory()
        finally:
            release_run_dir(lock)

    async def _main_holding_the_directory(self) -> int:
        from orchestrator.reaper import Reaper
        from orchestrator.run.fleet_keeper import FLEET_LOG
        from orchestrator.run.loop import RunLoop

        if not self.resume:
            refuse_a_run_dir_holding_a_run(self.run_dir)  # again, now that no other run can begin there
            # A run before this one that stopped in its set-up (`resolve_config` let this one take
            # the directory: nothing of it was dispatched, recorded or published) leaves its config,
            # its id and the engines it started; this run is a new one.
            if (self.run_dir / CONFIG_FILE).exists():
                log.info("run.dir_taken_over", why="the run there stopped in its set-up: nothing of it was "
                                                    "dispatched, recorded or published")
            for name in ("run_id", FLEET_LOG):
                (self.run_dir / name).unlink(missing_ok=True)
        self.state = "starting"
        self.run_id = self._run_id()
        self.cluster = self._cluster_side()  # before the HTTP server, which listens at its node's address
        self._start_http()  # before any engine: a port in use fails here, named
        if not self.resume:
            (self.run_dir / CONFIG_FILE).write_bytes(msgspec.json.format(msgspec.json.encode(self.config)))
        self.loop = RunLoop(self)
        # Every process started from here on dies with the run, even when this one is SIGKILLed.
        self.reaper = Reaper.start()
        # In-process engines' core and worker processes leave a terminal's Ctrl-C to this one,
        # whose graceful stop records every rollout and then stops them (transports.engine_signals).
        os.environ[ENGINE_CHILD_ENV] = "1"
        try:
            await self._run_with_services()
        finally:  # (if this process dies instead, the watchdog notices and sweeps all the same)
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.reaper.stop)
        stats = self.recorder_stats
        print(summary(self.progress.state, stats, str(self.run_dir), self.http and self.http.url,
                      stopped=self.loop.stop_reason if self.loop.stop_reason not in ("", "done") else None,
                      startup=self.startup.line()))
        if self.loop.failure:
            raise RunFailed(self.loop.failure)
        return 0

    async def _run_with_services(self) -> None:
        with self.progress:
            async with anyio.create_task_group() as services:
                if self.http is not None:
                    services.start_soon(self.http.serve, self.http_socket)
                interrupts = anyio.CancelScope()
                self._linger_over = anyio.Event()
                try:
                    restored_actions = await self._setup()
                    services.start_soon(self._interrupts, interrupts)
                    self.state = "running"
                    if self.scheduler.done_steps < self.max_steps:
                        await self.loop.main(restored_actions)
                    else:  # the resume only recorded the last steps' consumption: nothing left
                        log.info("run.already_finished", step=self.scheduler.done_steps, max_steps=self.max_steps)
                finally:
                    self.state = "stopping"
                    await self._teardown()
                self.state = "finished"
                if self.http is not None:
                    await self._linger()
                    self.http.stop()
                interrupts.cancel()

    async def _interrupts(self, scope: anyio.CancelScope) -> None:
        """From the end of set-up to the end of the run, the one receiver of SIGINT and SIGTERM
        (during set-up a Ctrl-C interrupts it as Python does; one receiver only: a second one
        would replace this one's handler, and closing either removes both). The first signal
        stops the run gracefully; a SIGINT once the run is stopping (a second Ctrl-C, or one
        during the teardown, however fast the graceful part was) exits 130 at once, and the
        watchdog stops what is left; while the finished run lingers, either signal ends it."""
        with scope, anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                if self.state == "finished":
                    self._linger_over.set()
                elif signum == signal.SIGINT and (self.loop.stop_requested.is_set() or self.state != "running"):
                    os._exit(130)
                else:
                    self.loop.request_stop(signal.Signals(signum).name)

    def _already_finished(self) -> bool:
        """A resumed run that reached its max steps says so and starts nothing."""
        done = finished_steps(self.run_dir, self.config, self.max_steps)
        if done is None:
            return False
        log.info("run.already_finished", step=done, max_steps=self.max_steps)
        print(f"inflight: {self.run_dir} already reached step {done} (max steps {self.max_steps}): nothing to do; "
              f"--max-steps N with N > {done} continues it")
        return True

    async def _linger(self) -> None:
        """Keep answering /stats and /metrics over the finished, flushed log for run.linger_s."""
        linger = self.config.run.linger_s
        if linger <= 0:
            return
        log.info("run.lingering", seconds=linger, url=self.http.url)
        with anyio.move_on_after(linger):
            await self._linger_over.wait()  # set by `_interrupts` on SIGINT or SIGTERM

    def _cluster_side(self):
        """With `[cluster]`, the run's side of it (engines and trainer nodes placed by Ray,
        docs/cluster.md): its address is known now, the cluster joined only when engines are placed."""
        if self.config.cluster is None:
            return None
        from orchestrator.run.cluster import ClusterSide

        return ClusterSide(self.config.cluster, self.run_id)

    def _run_id(self) -> str:
        path = self.run_dir / "run_id"
        if path.exists():
            return path.read_text().strip()
        run_id = uuid.uuid4().hex[:12]
        path.write_text(run_id + "\n")
        return run_id

    async def _setup(self) -> list:
        from orchestrator.engines import make_engine
        from orchestrator.fleet.adapters import probe_targets
        from orchestrator.model import ensure_model
        from orchestrator.observe.metrics import RunMetrics
        from orchestrator.run.recording import Recorder, keep_run_template, policy_identity
        from orchestrator.run.resume import DispatchJournal
        from orchestrator.scoring.scorer import make_scorer
        from orchestrator.tasks import make_task
        from orchestrator.tasks.entrypoint import run_search_path
        from orchestrator.tasks.templates import template_text
        from orchestrator.tasks.user_code import UserCode
        from orchestrator.trainer.launcher import TrainerProcess

        config = self.config
        self.progress.state.status = "building the model" if not Path(config.engine.model).exists() else "starting"
        self.progress.refresh()
        with self.startup.phase("model"):
            model_dir = str(await anyio.to_thread.run_sync(
                lambda: ensure_model(config.engine.model, preset=config.run.model_preset, seed=config.run.seed)))
        lora = config.trainer.lora
        template = template_text(config.task.chat_template, "task.chat_template")
        keep_run_template(self.run_dir, template)
        self.identity = policy_identity(model_dir, config.engine.dtype, self.logprobs_mode,
                                        lora.identity if lora is not None else None, chat_template=template)
        self.metrics = RunMetrics()
        self.recorder = Recorder(self.run_dir, fsync_every_records=config.run.fsync_every_records,
                                 fsync_every_ms=config.run.fsync_every_ms, on_record=self.metrics.on_record)
        self.journal = DispatchJournal(self.run_dir)
        self.search_path = run_search_path(self.run_dir, getattr(self, "config_path", None))
        # Every call into the user's code (steps, tools, agents) runs through one runner: one
        # thread for each rollout the scheduler may keep in flight (tasks/user_code.py).
        user_code = UserCode(threads=config.scheduler.max_inflight)
        # The trainer needs nothing of the task: it loads its model while the task builds (a few
        # seconds of imports and the tokenizer), the engines start and the scoring workers build
        # theirs. A task that fails to build stops it (`_teardown`), as any start-up failure.
        self.trainer = TrainerProcess(config, self.run_dir, model_dir, resume=self.resume,
                                      rendezvous=self.cluster and self.cluster.rendezvous())
        self.engines = []
        ready = None

        async def start_trainer() -> None:
            nonlocal ready
            with self.startup.phase("trainer"):
                if self.cluster is not None:
                    await self.cluster.start_trainer_nodes(self.trainer)
                ready = await self.trainer.start()

        async def start_scorer() -> None:
            with self.startup.phase("scoring"):
                await self.scorer.start()

        async def start_engines() -> None:
            with self.startup.phase("engines"):
                async with anyio.create_task_group() as engines:
                    for engine in self.engines:
                        engines.start_soon(engine.start)

        async with anyio.create_task_group() as tg:
            tg.start_soon(start_trainer)
            with self.startup.phase("task"):
                # In the runner's daemon thread, bounded: a factory that blocks cannot hang the start.
                self.task = await user_code.call(lambda: make_task(
                    config.task, model_dir, search_path=self.search_path, sampling=self.sampling, user_code=user_code),
                    timeout_s=config.task.build_timeout_s, what=f"building the task ({_task_source(config.task)})")
            self._serve_agent_endpoint()
            # A multi-turn task's reward is its episode's: no scoring pool to start.
            pool = "thread" if getattr(self.task, "episodic", False) else config.task.scoring_pool
            self.scorer = make_scorer(self.task, pool=pool, workers=config.task.score_workers,
                                      timeout_s=config.task.score_timeout_s, spare=config.task.score_spare_worker,
                                      builder=functools.partial(make_task, config.task, model_dir,
                                                                search_path=self.search_path, scoring_only=True,
                                                                sampling=self.sampling))
            self.evaluator = await self._evaluator(model_dir)
            self.progress.state.status = "starting the trainer and engines"
            self.progress.refresh()
            engine_configs = [(engine_id, msgspec.structs.replace(engine_config, model=model_dir,
                                                                  logprobs_mode=self.logprobs_mode))
                              for engine_id, engine_config in config.engine_configs()]
            self.engine_base_config = engine_configs[0][1]  # what an engine that joins mid-run is held to
            if self.cluster is not None:
                with self.startup.phase("placement"):
                    self.engines = await self.cluster.place(engine_configs)
            else:
                self.engines = [make_engine(c, engine_id, log_dir=self.run_dir) for engine_id, c in engine_configs]
            # Side by side with the trainer: the engines start, the scoring workers build the task.
            tg.start_soon(start_scorer)
            tg.start_soon(start_engines)
        self.fleet = _make_fleet(self.engines, config, ready.weights_root)
        with self.startup.phase("fleet"):
            if config.trainer.lora is None and self.cluster is not None:  # workers pull over HTTP
                self.cluster.serve_weights(self.http.app, ready.weights_root)
                await self.fleet.setup(ready.plan_json, ready.weights_root, timeout_s=config.transport.timeout_s,
                                       pull=self.cluster.pull(self.http.url))
            elif config.trainer.lora is None:  # adapters need no receiver in the workers
                await self.fleet.setup(ready.plan_json, ready.weights_root, timeout_s=config.transport.timeout_s)
            else:
                await probe_targets(self.engines, model_dir, config.trainer.lora, self.run_dir)
        with self.startup.phase("restore"):
            restored = await restore(self, ready)
            if ready.version > 0:  # resumed: serve the newest published weights before any rollout
                record = await self.fleet.activate(ready.version)
                self.record_activation(record)
                if record.outcome not in ("activated", "engine_fenced"):
                    raise RunFailed(f"could not activate version {ready.version} on resume: {record.message}")
        self.metrics.live_version.set(self.fleet.live_version)
        self.progress.state.live_version = self.fleet.live_version
        self.scheduler = sch.Scheduler(config.scheduler, [e.engine_id for e in self.engines],
                                       capacities={e.engine_id: e.config.max_num_seqs for e in self.engines},
                                       min_engines=config.fleet.min_engines,
                                       max_steps=self.max_steps, done_steps=ready.step,
                                       live_version=self.fleet.live_version, published_version=ready.version,
                                       next_group_id=restored.next_group_id, max_groups=self._max_groups())
        self.scheduler.restore(restored.restored)
        self._start_http()
        self._start_tracking()
        self.progress.state.status = "running"
        self.startup.first_rollout()
        log.info("run.startup", **self.startup.as_dict())
        return self.scheduler.start(at=time.monotonic())

    async def _evaluator(self, model_dir: str):
        """The held-out evaluation ([eval] every_steps > 0), its prompts built and checked now."""
        from orchestrator.run.eval import Evaluator
        from orchestrator.scoring.scorer import Scorer
        from orchestrator.tasks import make_task

        config = self.config
        if not config.eval.every_steps:
            return None
        task_config = config.eval.task_config(config.task)
        task = await anyio.to_thread.run_sync(lambda: make_task(
            task_config, model_dir, search_path=self.search_path, where="eval", tokenizer=self.task.tokenizer))
        scorer = Scorer(task, workers=task_config.score_workers, timeout_s=task_config.score_timeout_s)
        evaluator = Evaluator(task, scorer, config.eval, self.sampling)
        await evaluator.load()
        return evaluator

    def _max_groups(self) -> int | None:
        """A dataset read for a set number of epochs has that many prompts (groups)."""
        rows, epochs = self.task.rows, self.config.task.epochs
        return rows * epochs if rows is not None and epochs is not None else None

    def record_activation(self, record) -> None:
        from replay.records import ActivationRecord, EngineActivation

        self.recorder.submit(ActivationRecord(
            version=record.version, outcome=record.outcome,
            engines=[EngineActivation(eo.engine, eo.transfer_s, eo.pause_s, eo.outcome) for eo in record.engines],
            activated_at=time.time(), message=record.message[:1000], strategy=record.strategy,
            kv_policy=record.kv_policy, kv_carried=record.kv_carried))
        if self.tracking is not None:
            self.tracking.activation(record)

    # -- side services ---------------------------------------------------------------------------
    def _serve_agent_endpoint(self) -> None:
        """An agent task's OpenAI-compatible endpoint, on the run's HTTP server (docs/agents.md)."""
        endpoint = getattr(self.task, "agent_endpoint", None)
        if endpoint is None:
            return
        from orchestrator.tasks.agent import sampling_checker
        from orchestrator.tasks.token_route import served_routes

        if self.http is None:
            raise ConfigError("http.enabled", "an agent task talks to the run's OpenAI-compatible endpoint, served "
                                              "by its HTTP server: http.enabled must be true")
        endpoint.sampling_check = sampling_checker(self.sampling)
        self.http.app.router.routes.extend(served_routes(endpoint))
        self.task.base_url = self.http.url

    def _start_http(self) -> None:
        """Bind the live query server's socket (once; `main` does it before anything starts, so
        that a port in use fails the run at once, named). Until the replay log and metrics
        exist, /stats and /metrics answer 503 and /healthz says "starting"."""
        from orchestrator.observe.http import HttpServer, build_app
        from orchestrator.run.live import live_metrics, live_stats

        if not self.config.http.enabled or self.http is not None:
            return
        app = build_app(functools.partial(live_stats, self), functools.partial(live_metrics, self), self._health)
        host = self.config.http.host
        if self.cluster is not None:  # the engines on other hosts pull versions from it
            host = self.cluster.http_host(host)
        self.http = HttpServer(app, host, self.config.http.port, self.run_dir)
        try:
            self.http_socket = self.http.bind()
        except OSError as exc:
            raise ConfigError("http.port", f"cannot listen on {host}:{self.config.http.port}: {exc}") from None
        from orchestrator.run.fleet_control import serve_fleet_control

        serve_fleet_control(self, app)

    def _health(self) -> dict:
        return run_health(self)

    def _start_tracking(self) -> None:
        from orchestrator.observe.tracking import Tracking

        self.tracking = Tracking(self.run_dir, self.config, self.run_id)

    def tensorboard_step(self, m, staleness: list[int], components: dict[str, float] | None = None) -> None:
        if self.tracking is not None:
            self.tracking.step_done(m, staleness, components or {}, self.metrics.tokens_per_second)

    # -- teardown --------------------------------------------------------------------------------
    async def _teardown(self) -> None:
        """Shielded and bounded: trainer, engines, the log (flushed), side services."""
        with anyio.CancelScope(shield=True):
            if getattr(self, "trainer", None) is not None:
                await self.trainer.stop()
            if getattr(self, "loop", None) is not None and getattr(self, "recorder", None) is not None:
                self.loop.settle_lost_batches()  # the trainer is gone: its last step is what its checkpoint says
            # The engines it started with, and those that joined since (a replacement is ours).
            engines = {e.engine_id: e for e in getattr(self, "engines", [])}
            fleet = getattr(self, "fleet", None)
            engines.update(fleet.engines if fleet is not None else {})
            async with anyio.create_task_group() as tg:
                for engine in engines.values():
                    tg.start_soon(_shutdown_engine, engine)
                for scorer in (getattr(self, "scorer", None), getattr(getattr(self, "evaluator", None), "scorer", None)):
                    if scorer is not None:
                        tg.start_soon(scorer.aclose)
            if self.cluster is not None:  # the placement group released, the cluster left running
                await self.cluster.close()
            recorder = getattr(self, "recorder", None)
            self.recorder_stats = {}
            if recorder is not None:
                try:
                    await recorder.flush()
                    self.recorder_stats = recorder.stats()
                finally:
                    await anyio.to_thread.run_sync(recorder.close)
            if getattr(self, "journal", None) is not None:
                self.journal.close()
            if self.tracking is not None:
                self.tracking.close()


def _task_source(task) -> str:
    """What builds the task, for a timeout's message."""
    if task.entrypoint:
        return f"task.entrypoint {task.entrypoint}"
    return f"task.dataset {task.dataset}" if task.dataset else f"task.name {task.name}"


async def _shutdown_engine(engine) -> None:
    try:
        with anyio.move_on_after(60):
            await engine.shutdown()
    except Exception as exc:  # noqa: BLE001 - a dead engine has nothing left to stop
        log.warning("engine.shutdown_failed", engine=engine.engine_id, error=str(exc))


def _make_fleet(engines, config: RunConfig, weights_root: str):
    """The run's fleet: a LoRA run's versions are adapters (the `adapter` strategy: requests name
    them, nothing pauses; "drain": a request ends on the weights it began with, here without
    waiting for it); other runs activate as `[activation]` says."""
    from orchestrator.fleet.adapters import AdapterStore
    from orchestrator.fleet.fleet import Fleet

    lora = config.trainer.lora
    if lora is None:
        return Fleet.from_config(engines, config.activation)
    store = AdapterStore(root=Path(weights_root), max_loras=lora.resident(config.scheduler.max_off_policy_steps))
    return Fleet(engines, strategy="adapter", kv_policy="drain", timeouts=config.activation.timeouts(), adapters=store)
