"""Recording: the replay writer thread, the live statistics, and the records the run writes.

`Recorder` owns the run's `ReplayLog`. The event loop never touches the file: `submit(record)`
queues the record (no I/O, no wait); one writer thread appends what is queued in batches under the
log's fsync policy and feeds the live statistics and metrics. The records submitted during one turn
of the event loop reach the writer together, at the end of that turn: one wake-up of the writer
thread (a futex call, then a hand-over of the GIL) for all of them, not one per record. `flush()`
(awaitable) returns once everything submitted so far is durable. A record the log refuses
(InvalidRecordError: a bug, never user data) is logged with its field and counted, and the
thread goes on: nothing acknowledged is lost for it.

The live `/stats` is computed by the same code as `inflight stats --json` (`replay`'s
`LiveStats`), fed by the writer thread with each record the log accepted, so at a quiescent
moment (everything submitted written) they are equal; metrics count the same records.

`build_rollout_record` turns a rollout's outcome into its one terminal `RolloutRecord`, with the
run's own ids, group, prompt, identity, sampling and the timings the fleet observed: a value
that was not observed is absent, never a default.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import queue
import threading
from pathlib import Path
from typing import Any

import anyio
import msgspec

from orchestrator.fleet.rollouts import FleetCompletion
from orchestrator.observe.logging import get_logger
from orchestrator.scheduling.scheduler import Terminal
from replay.errors import InvalidRecordError
from replay.log import FsyncPolicy, ReplayLog
from replay.records import (
    COMPLETED,
    Dropped,
    Errored,
    PolicyIdentity,
    Record,
    RolloutRecord,
    SamplingSettings,
    Timings,
)

log = get_logger(__name__)
_FLUSH = object()
_STOP = object()


class Recorder:
    """The replay log behind a queue and one writer thread."""

    def __init__(self, run_dir: Path, *, fsync_every_records: int = 256, fsync_every_ms: float = 200.0,
                 on_record=None) -> None:
        from replay.query import LiveStats

        self.run_dir = Path(run_dir)
        self.log = ReplayLog.open(self.run_dir, fsync=FsyncPolicy(every_records=fsync_every_records,
                                                                  every_ms=fsync_every_ms))
        self.live = LiveStats()
        self.submitted = 0
        self.written = 0
        self.refused = 0
        self._on_record = on_record  # metrics: called with each record the log accepted (writer thread)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._turn: list[Record] = []  # submitted during this turn of the event loop, not yet queued
        self._failure: BaseException | None = None
        self._stats_lock = threading.Lock()  # live stats: added on the writer thread, read on the loop's
        self._thread = threading.Thread(target=self._write_forever, name="replay-writer", daemon=True)
        self._thread.start()

    # -- the loop's side ---------------------------------------------------------------------
    def submit(self, record: Record) -> None:
        """Queue one record (no I/O), from the event loop's thread or with no loop running. Raises
        if the writer failed: the run must stop."""
        if self._failure is not None:
            raise RuntimeError(f"the replay writer failed: {self._failure!r}") from self._failure
        self._turn.append(record)
        self.submitted += 1
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # not on an event loop: at once
            self._hand_over()
            return
        if len(self._turn) == 1:
            loop.call_soon(self._hand_over)

    def _hand_over(self) -> None:
        turn, self._turn = self._turn, []
        if turn:
            self._queue.put(turn)

    def preload(self, records) -> None:
        """Records already in the log (a resumed run): counted by the live statistics and the
        metrics, not written again."""
        records = list(records)
        with self._stats_lock:
            self.submitted += len(records)
            self._accepted(records)

    def _accepted(self, records: list[Record]) -> None:
        """(Under the statistics' lock.) Records the log holds: counted, and fed to the live
        statistics and the metrics."""
        self.written += len(records)
        self.live.add_many(records)
        if self._on_record is not None:
            for record in records:
                self._on_record(record)

    async def flush(self, timeout_s: float = 60.0) -> None:
        """Wait until everything submitted so far is durable."""
        self._hand_over()
        done = threading.Event()
        self._queue.put((_FLUSH, done))
        with anyio.CancelScope(shield=True):
            ok = await anyio.to_thread.run_sync(done.wait, timeout_s)
        if self._failure is not None:
            raise RuntimeError(f"the replay writer failed: {self._failure!r}") from self._failure
        if not ok:
            raise TimeoutError(f"the replay log did not flush within {timeout_s}s")

    def close(self, timeout_s: float = 60.0) -> None:
        """Write and sync what is queued, then close the log (blocking; call at the end)."""
        self._hand_over()
        self._queue.put(_STOP)
        self._thread.join(timeout_s)
        self.log.close()

    def stats(self, filters=None) -> dict[str, Any]:
        """What `inflight stats --json` prints for the records submitted so far."""
        with self._stats_lock:
            return self.live.snapshot(filters, log_info=self.log_info())

    def log_info(self) -> dict[str, Any]:
        return {"directory": self.log.log_dir, "records": self.written, "corrupt_records": 0,
                "invalid_records": 0, "unknown_records": 0, "torn_tail_bytes": 0}

    # -- the writer thread -------------------------------------------------------------------
    def _write_forever(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while True:  # drain what is waiting: one fsync decision per batch, not per record
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            for item in batch:
                if item is _STOP:
                    self._sync()
                    return
                if type(item) is tuple:  # (_FLUSH, its event)
                    self._sync()
                    item[1].set()
                    continue
                if not self._append(item):
                    self._release_waiters()
                    return

    def _append(self, records: list[Record]) -> bool:
        """Append one turn's records; False once the file failed (nothing more can be made durable).
        The turn's accepted records are then counted under one take of the statistics' lock."""
        accepted: list[Record] = []
        ok = True
        for record in records:
            try:
                self.log.append(record)
                accepted.append(record)
            except InvalidRecordError as exc:
                self.refused += 1
                log.error("recording.record_refused", field=exc.field, reason=exc.reason,
                          type=type(record).__name__)
            except BaseException as exc:
                self._failure = exc
                log.error("recording.writer_failed", error=repr(exc))
                ok = False
                break
        try:
            with self._stats_lock:
                self._accepted(accepted)
        except BaseException as exc:
            self._failure = exc
            log.error("recording.writer_failed", error=repr(exc))
            return False
        return ok

    def _sync(self) -> None:
        try:
            self.log.flush()
        except BaseException as exc:
            self._failure = exc
            log.error("recording.flush_failed", error=repr(exc))

    def _release_waiters(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if type(item) is tuple:  # (_FLUSH, its event)
                item[1].set()


# ---------------------------------------------------------------------------------------------
# Identity and records.


def _sha256_file(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    _update_from_file(digest, path)
    return digest.hexdigest()


def _update_from_file(digest, path: Path, chunk: int = 8 << 20) -> None:
    # Streamed: a real model's weights do not fit in memory twice.
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)


# Weight files in the order a loader prefers them: safetensors, else PyTorch pickles (a model
# saved with safe_serialization=False); the engine and the trainer load the same kind.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
# Tokenizer files besides tokenizer.json, for a tokenizer without one (sentencepiece, BPE vocab).
TOKENIZER_FILES = ("tokenizer.model", "vocab.json", "merges.txt", "tiktoken.model", "added_tokens.json")


def weights_digest(model_dir: str | Path) -> str:
    """sha256 over the names and bytes of a model directory's weight files (see WEIGHT_PATTERNS)."""
    model = Path(model_dir)
    digest = hashlib.sha256()
    for pattern in WEIGHT_PATTERNS:
        weights = sorted(model.glob(pattern))
        if weights:
            for path in weights:
                digest.update(path.name.encode())
                _update_from_file(digest, path)
            break
    return digest.hexdigest()


def tokenizer_digest(model_dir: str | Path) -> str:
    """sha256 of tokenizer.json; without one, of the other tokenizer files present; "" if none."""
    model = Path(model_dir)
    whole = _sha256_file(model / "tokenizer.json")
    if whole is not None:
        return whole
    digest = hashlib.sha256()
    found = False
    for name in TOKENIZER_FILES:
        if (model / name).is_file():
            digest.update(name.encode())
            _update_from_file(digest, model / name)
            found = True
    return digest.hexdigest() if found else ""


# RUN_DIR's copy of the task's own chat template (`task.chat_template` as a path): what rendered the
# prompts, which `inflight export-model` writes into an export in place of the base model's.
RUN_TEMPLATE = "chat_template.jinja"


def keep_run_template(run_dir: Path, text: str | None) -> None:
    """RUN_DIR/chat_template.jinja holds `text` (written whole, then renamed); None: the model's
    own template renders, and no copy is kept."""
    path = Path(run_dir) / RUN_TEMPLATE
    if text is None:
        path.unlink(missing_ok=True)
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def chat_template_of(model_dir: str | Path) -> str:
    """The chat template transformers (and hence vLLM) loads for this directory: the file
    chat_template.jinja (where transformers saves it since 4.43) wins over tokenizer_config.json's
    `chat_template`, which may also be a list of named templates; "" when there is none."""
    model = Path(model_dir)
    jinja = model / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config = model / "tokenizer_config.json"
    if not config.is_file():
        return ""
    template = json.loads(config.read_text()).get("chat_template") or ""
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def policy_identity(model_dir: str | Path, serving_precision: str, logprobs_mode: str,
                    adapter: str | None = None, chat_template: str | None = None) -> PolicyIdentity:
    """What names the policy besides its version: the base checkpoint's weights, the tokenizer
    and chat template (hashes of the files the engine loaded; `chat_template`: the text of the
    template that renders the prompts instead, when the task names one), precision and logprobs
    mode."""
    model = Path(model_dir).resolve()
    template = chat_template if chat_template is not None else chat_template_of(model)
    return PolicyIdentity(
        base_checkpoint=f"{model}@sha256:{weights_digest(model)[:16]}",
        tokenizer_hash=tokenizer_digest(model)[:16],
        chat_template_hash=hashlib.sha256(template.encode()).hexdigest()[:16] if template else "",
        serving_precision=serving_precision,
        logprobs_mode=logprobs_mode,
        adapter=adapter,
    )


class RolloutContext(msgspec.Struct, frozen=True):
    """What the run knows about a rollout besides the engine's answer. (A struct: built for
    every rollout, and a frozen dataclass's field-by-field `object.__setattr__` costs ~10x.)"""

    rollout_id: int
    group_id: int
    prompt_id: str
    prompt_token_ids: tuple[int, ...]
    dispatched_at: float  # when the scheduler dispatched it (wall clock)
    dispatched_version: int  # the scheduler's view; the fleet's answer (>= this) wins when there is one
    engine_id: str


def build_rollout_record(ctx: RolloutContext, terminal: Terminal, completion: FleetCompletion | None,
                         rewards: dict[str, float] | None, *, identity: PolicyIdentity,
                         sampling: SamplingSettings) -> RolloutRecord:
    """The one terminal record of a rollout. `completion` is None when no engine answered
    (the run stopped before the request returned): no tokens, and no invented timings."""
    if terminal.status == "completed":
        status = COMPLETED
    elif terminal.status == "dropped":
        status = Dropped(terminal.reason or "dropped")
    else:
        status = Errored(terminal.reason or "error", terminal.message[:500])
    tokens: list[int] = []
    logprobs: list[float] = []
    changes, kv, environment, episode_end, finish_reason = None, False, None, None, None
    timings = Timings(dispatched_at=ctx.dispatched_at)
    dispatched_version, engine_id = ctx.dispatched_version, ctx.engine_id
    if completion is not None:
        # from_lists packs the lists as they are (struct: no copy to an intermediate array).
        tokens, logprobs = completion.token_ids, completion.logprobs
        changes = completion.change_points() if completion.token_ids else None
        # The fleet's dispatch instant is when the request went to the engine (later than the
        # scheduler's decision, by the journal's fsync): the record keeps the decision.
        timings = Timings(dispatched_at=ctx.dispatched_at, first_token_at=completion.first_token_at,
                          finished_at=completion.finished_at)
        kv = completion.kv_carried_across_versions
        environment = completion.environment_spans if completion.token_ids else None
        episode_end = completion.episode_end
        finish_reason = completion.finish_reason  # what the engine (or the episode's end) said
        dispatched_version, engine_id = completion.dispatched_version, completion.engine_id
    return RolloutRecord.from_lists(
        rollout_id=ctx.rollout_id, group_id=ctx.group_id, prompt_id=ctx.prompt_id, engine_id=engine_id,
        prompt_token_ids=ctx.prompt_token_ids, completion_token_ids=tokens,
        completion_logprobs=logprobs, dispatched_version=dispatched_version, identity=identity,
        timings=timings, version_changes=changes, kv_carried_across_versions=kv, status=status,
        rewards=rewards or {}, sampling=sampling, environment_spans=environment, episode_end=episode_end,
        finish_reason=finish_reason)
