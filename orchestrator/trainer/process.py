"""The trainer process: `python -m orchestrator.trainer.process --connect ADDR --run-dir DIR
--model MODEL_DIR --config-json JSON [--resume]`.

It connects to the orchestrator's link (`orchestrator.trainer.link`), says `Ready`, then for
each `Batch(step=s)`: one optimizer step from version s-1; when s % publish_every == 0 it
makes the step durable (first: a checkpoint, or a journal entry and a checkpoint written in the
background, `checkpoint_background`) and publishes version s (then), and answers `StepDone`. `Stop` ends it
(exit 0); an exception answers `Failed` and exits 1; so does an orchestrator that went away
(the parent pid changed, or the `--orchestrator-pid` process is gone).

Under torchrun (env WORLD_SIZE > 1; the launcher starts `python -m torch.distributed.run
--nproc-per-node N -m orchestrator.trainer.process ...` when trainer.world_size = N > 1): the
process group is gloo on CPU (NCCL when CUDA is present: written, not yet run on a GPU), the
model is wrapped with FSDP2 (`fully_shard` per decoder layer, then the root), and each rank
trains on its slice of every batch (advantages come from the whole batch; FSDP averages the
gradients, the loss is scaled so that the step equals the single-process one). Only rank 0
opens the link; every message it receives is broadcast to the other ranks, which handle it in
step, so all ranks train, checkpoint, publish and stop together. Publishing gathers each
tensor to rank 0 when its bucket needs it (`transports.refit.gather`); checkpoints hold the
full (gathered) state, written by rank 0, and resume at any world size.

With `trainer.lora` the model is wrapped with a PEFT LoRA adapter before it is sharded
(`orchestrator.trainer.lora`); the optimizer covers the adapter only, checkpoints hold it
alone, and each version is published as a PEFT adapter directory (`publish_adapter`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

import msgspec
import torch

from orchestrator.config.run import RunConfig
from orchestrator.observe.logging import configure_logging, get_logger
from orchestrator.trainer import checkpoint, checkpoint_background, lora, restore, step_journal
from orchestrator.trainer.checkpoint_background import BackgroundWriter
from orchestrator.trainer.link import (
    Batch,
    Failed,
    Ready,
    StepDone,
    Stop,
    TrainerClient,
    TrainerLinkTimeout,
    decode,
    encode,
    pack_f32,
)
from orchestrator.trainer.orphan import Orphan
from orchestrator.trainer.placement import pin, published_dtype, trainer_device  # noqa: F401 - pin re-exported
from orchestrator.trainer.publish import Publisher
from orchestrator.trainer.publish_adapter import AdapterPublisher
from orchestrator.trainer.ranks import Ranks, init_group, leave_group, shard, share
from orchestrator.trainer.step import StepResult, train_step, train_step_sharded  # noqa: F401 - re-exported

log = get_logger("orchestrator.trainer")

# How often the idle trainer checks that its orchestrator (the parent process) still exists;
# under torchrun also how often rank 0 tells the other ranks it is still waiting.
PARENT_POLL_S = 1.0
# What rank 0 broadcasts when the orchestrator is gone (instead of a message or None: idle).
ORPHANED = "orphaned"
# Fault injection for the exactly-once tests: the trainer dies right after it checkpointed
# (and published) this step, before its StepDone reaches the orchestrator.
CRASH_AFTER_CHECKPOINT = "INFLIGHT_FAULT_TRAINER_EXIT_AFTER_STEP"
CRASH_EXIT_CODE = 17
# Fault injection for the SIGKILL-and-resume tests: the trainer stops (sleeps, holding its
# state) right after this step is durable and published, so a test kills the run at a known step
# instead of racing a poll against a step that lasts a fraction of a second.
HOLD_AFTER_STEP = "INFLIGHT_FAULT_TRAINER_HOLD_AFTER_STEP"
# How long a trainer that ends lets a background checkpoint under way finish (the journal makes
# up for one cut short).
WRITER_CLOSE_TIMEOUT_S = 60.0



class Trainer:
    """The trainer's state between messages: model, optimizer, step, publisher."""

    def __init__(self, run_dir: str, model_dir: str, config: RunConfig, ranks: Ranks | None = None) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        # stderr carries JSON lines only: no progress bars, no advisory warnings.
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        self.run_dir = run_dir
        self.config = config
        self.tc = config.trainer
        self.ranks = ranks or Ranks()
        self.device = trainer_device(self.tc, self.ranks)
        # No attn_implementation: transformers picks its own (SDPA where the model supports it).
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, self.tc.dtype))
        self.model.eval()  # no dropout; the gradient does not depend on the mode
        if self.tc.lora is not None:  # before sharding: FSDP2 then shards the adapter too
            self.model = lora.wrap(self.model, self.tc.lora, seed=self.tc.seed)
        if self.device.type != "cpu":  # written, not yet run on a GPU
            self.model.to(self.device)
        if self.ranks.sharded:
            shard(self.model, self.ranks, self.device)
        if self.tc.lora is not None:
            lora.settle_logprob_path(self.model)
        # Only what trains (a LoRA run: the adapter) has optimizer state.
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(trainable, lr=self.tc.lr, weight_decay=self.tc.weight_decay)
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0  # padding is masked out: any id will do
        self.step = 0
        self.current: int | None = None  # the step being trained (named by Failed if it raises)
        self.done_at: float | None = None  # perf_counter when its last step ended (None: none yet)
        self.resumed = False
        self.publisher: Publisher | AdapterPublisher | None = None
        self.writer = BackgroundWriter(run_dir, self.tc.keep_checkpoints) if self.tc.background_checkpoints else None
        self.skipped = 0  # due background checkpoints skipped in a row (the writer was busy)

    def start(self, resume: bool, progress=None) -> None:
        """Restore the newest checkpoint (with --resume), train the journaled steps after it again
        (`restore`; `progress` gets a `Replaying` before each), repair its version, open the
        publisher. Under torchrun rank 0 (which owns the run directory) decides, and every rank
        follows."""
        decision: dict = {}
        if self.ranks.rank == 0:
            try:
                decision = {"step": self._resume_step(resume)}
            except RuntimeError as exc:
                decision = {"error": str(exc)}
        if self.ranks.sharded:
            decision = share(decision, self.ranks)
        if "error" in decision:
            raise RuntimeError(decision["error"])
        step = decision["step"]
        if step:
            if self.ranks.sharded:
                checkpoint.load_full(self.run_dir, step, self.model, self.optimizer, self.ranks.rank)
            else:
                checkpoint.load(self.run_dir, step, self.model, self.optimizer)
            self.step, self.resumed = step, True
        replay = step_journal.to_replay(self.run_dir, step) if resume and not self.ranks.sharded else []
        if self.tc.lora is not None:
            self.publisher = AdapterPublisher(self.model, self.run_dir, self.config.transport, rank=self.ranks.rank,
                                              dtype=published_dtype(self.config))
        else:
            self.publisher = Publisher(self.model, self.run_dir, self.config.transport, version=self.step,
                                       bucket_bytes=self.tc.bucket_bytes, rank=self.ranks.rank,
                                       world=self.ranks.world, dtype=published_dtype(self.config))
        if self.ranks.sharded:
            self._check_same_run()
        if replay:
            restore.replay(self, replay, progress)
        if self.ranks.rank == 0:
            newer = [v for v in self.publisher.published() if v > self.step]
            if newer:
                decision = {"error": f"{self.publisher.root} holds version {newer[-1]} but the trainer starts at step "
                                     f"{self.step}: continuing would publish other weights under the same number"}
            else:
                # Crashed between checkpoint and publish: the checkpoint holds exactly these weights.
                decision = {"republish": self.step > 0 and self.step % self.tc.publish_every == 0
                            and not self.publisher.is_complete(self.step)}
        if self.ranks.sharded:
            decision = share(decision, self.ranks)
        if "error" in decision:
            raise RuntimeError(decision["error"])
        if decision["republish"]:
            if self.ranks.rank == 0:
                restore.check_republish(self, self.step)
            seconds = self.publisher.publish(self.step)
            log.info("trainer.republished", version=self.step, seconds=round(seconds, 4))
        if self.step and self.ranks.rank == 0 and self.publisher.is_complete(self.step):
            # The weights now held are the published ones (restore): the ledger names them, if
            # the crash came before it did.
            restore.record_published(self, self.step)

    def _check_same_run(self) -> None:
        """Every rank holds the same configuration and the same refit plan (the model's names,
        shapes and dtypes, the buckets): a host started with another --config-json or --model
        would gather shards in another order, pairing them with the wrong tensors."""
        import hashlib

        import torch.distributed as dist

        # A LoRA run has no refit plan: its adapter's names and shapes stand for the model.
        plan = self.publisher.plan_json or getattr(self.publisher, "layout_json", "")
        digest = hashlib.sha256(msgspec.json.encode(self.config) + b"\0" + plan.encode()).hexdigest()
        digests: list = [None] * self.ranks.world
        dist.all_gather_object(digests, digest)
        other = [r for r, d in enumerate(digests) if d != digests[0]]
        if other:
            raise RuntimeError(f"ranks {other} were started with another --config-json or --model than rank 0 (the "
                               "configuration or the refit plan differs): start every host with RUN_DIR/config.json "
                               "and the same base model")

    def _resume_step(self, resume: bool) -> int:
        steps = checkpoint.complete_steps(self.run_dir)
        journaled = step_journal.journaled_steps(self.run_dir)
        if journaled and not steps and not resume:
            raise RuntimeError(f"{step_journal.journal_dir(self.run_dir)} holds steps up to {journaled[-1]}: "
                               "start with --resume, or use a new run directory")
        if steps and not resume:
            raise RuntimeError(f"{checkpoint.checkpoints_root(self.run_dir)} holds checkpoints up to step {steps[-1]}: "
                               "start with --resume, or use a new run directory")
        if resume and steps:
            # A full-model checkpoint never loads into a LoRA trainer, nor the reverse (a RuntimeError).
            checkpoint.check_kind(self.run_dir, steps[-1], lora=self.tc.lora is not None)
        return steps[-1] if resume and steps else 0

    def ready(self) -> Ready:
        assert self.publisher is not None
        # The newest published version: a resumed trainer may stand at a journaled step that
        # publish_every skipped.
        version = self.step - self.step % self.tc.publish_every
        return Ready(step=self.step, version=version, plan_json=self.publisher.plan_json,
                     weights_root=str(self.publisher.root), pid=os.getpid(), resumed=self.resumed)

    def handle(self, batch: Batch) -> StepDone | Failed:
        self.current = batch.step
        expected = self.step + 1
        if batch.step != expected:
            return Failed(step=batch.step, error=f"batch for step {batch.step}, but {self.step} steps are done: "
                                                 f"expected step {expected}")
        if not batch.samples:
            return Failed(step=batch.step, error="empty batch")
        started = time.perf_counter()
        result = self._train(batch)
        self.step = batch.step
        metrics = dict(result.metrics, train_s=time.perf_counter() - started)
        if self.done_at is not None:  # idle since its last step: waiting for this batch
            metrics["wait_s"] = started - self.done_at
        publish = self.step % self.tc.publish_every == 0
        self._make_durable(batch, result, metrics, publish)
        version = self._publish(metrics) if publish else None
        if os.environ.get(CRASH_AFTER_CHECKPOINT) == str(self.step):  # fault injection (tests only)
            os._exit(CRASH_EXIT_CODE)
        if os.environ.get(HOLD_AFTER_STEP) == str(self.step):  # fault injection (tests only)
            while True:
                time.sleep(3600)
        seconds = time.perf_counter() - started
        log.info("trainer.step", step=self.step, version=version, loss=result.loss, reward_mean=result.reward_mean,
                 seconds=round(seconds, 4))
        self.done_at = time.perf_counter()
        return StepDone(step=self.step, version=version, loss=result.loss, reward_mean=result.reward_mean,
                        metrics=metrics, seconds=seconds, rollout_ids=result.rollout_ids,
                        advantages=pack_f32(result.advantages), log_ratio_mean=pack_f32(result.log_ratio_mean),
                        log_ratio_max_abs=pack_f32(result.log_ratio_max_abs))

    def _train(self, batch: Batch) -> StepResult:
        temperature = self.config.sampling.temperature
        if self.ranks.sharded:
            return train_step_sharded(self.model, self.optimizer, batch.samples, self.tc, self.pad_id, self.ranks,
                                      step=batch.step, temperature=temperature, device=self.device)
        return train_step(self.model, self.optimizer, batch.samples, self.tc, self.pad_id, step=batch.step,
                          temperature=temperature, device=self.device)

    def _make_durable(self, batch: Batch, result: StepResult, metrics: dict[str, float], publish: bool) -> None:
        """Before the step's version is published (see checkpoint.py for why the order
        matters): a checkpoint at every published version, or with trainer.checkpoint_every
        = k at every k-th step and a journal entry of each step between (step_journal). With
        background checkpoints every step is journaled and a due checkpoint is a snapshot that
        the writer thread writes while the next step trains (checkpoint_background)."""
        if not self.tc.checkpoint:
            return
        due = self.step % self.tc.checkpoint_every == 0 and publish
        t0 = time.perf_counter()
        meta = self._meta(result)  # one account of the step, whichever file holds it
        if self.writer is not None:
            metrics.update(self.writer.collect())  # the last write's figures; a failed one raises here
            step_journal.write(self.run_dir, batch, meta, published=publish)
            metrics["journal_s"] = time.perf_counter() - t0
            if due and self.writer.busy and self.skipped < self.tc.checkpoint_max_skips:
                self.skipped += 1  # the journal covers it; the trainer does not wait for the disk
                metrics["checkpoint_skipped"] = 1.0
            elif due:
                if self.writer.busy:  # skipped enough in a row: this one is written (bounds the replay)
                    metrics.update(self._wait_for_writer())
                self.skipped = 0
                t1 = time.perf_counter()
                self.writer.submit(checkpoint_background.take(self.model, self.optimizer, meta))
                metrics["checkpoint_s"] = time.perf_counter() - t1  # the snapshot: the step's share
        elif due:
            self._checkpoint(meta)
            metrics["checkpoint_s"] = time.perf_counter() - t0
        elif self.tc.journaled:
            step_journal.write(self.run_dir, batch, meta, published=publish)
            metrics["journal_s"] = time.perf_counter() - t0

    def _wait_for_writer(self) -> dict[str, float]:
        """The write under way, finished (bounded by trainer.step_timeout_s), before this step's
        checkpoint is handed to the writer and its version published."""
        t0 = time.perf_counter()
        figures = self.writer.collect(timeout_s=self.tc.step_timeout_s)
        if self.writer.busy:
            raise checkpoint.CheckpointError(f"the background checkpoint under way did not finish within "
                                             f"{self.tc.step_timeout_s} s (trainer.step_timeout_s), after "
                                             f"{self.skipped} skipped checkpoints (trainer.checkpoint_max_skips)")
        return {**figures, "checkpoint_wait_s": time.perf_counter() - t0}

    def _checkpoint(self, meta: checkpoint.CheckpointMeta) -> None:
        if self.ranks.sharded:
            checkpoint.save_full(self.run_dir, self.model, self.optimizer, meta, self.tc.keep_checkpoints,
                                 self.ranks.rank)
        else:
            checkpoint.save(self.run_dir, self.model, self.optimizer, meta, self.tc.keep_checkpoints)
            step_journal.prune(self.run_dir, meta.step)

    def checkpoint_journaled(self) -> None:
        """At a stop: checkpoint the newest journaled step, so that a resume has nothing to
        train again. Killed during it, the journal still holds every step."""
        if self.writer is not None:
            self.writer.collect(timeout_s=WRITER_CLOSE_TIMEOUT_S)  # the write under way first (maybe this step's)
            if self.writer.busy:  # one writer at a time; the journal still holds every step after it
                log.warning("trainer.checkpoint_at_stop_skipped", step=self.step, waited_s=WRITER_CLOSE_TIMEOUT_S)
                return
        journaled = step_journal.journaled_steps(self.run_dir) if self.tc.journaled else []
        if not journaled or journaled[-1] != self.step or self.step in checkpoint.complete_steps(self.run_dir):
            return
        entry = step_journal.read(self.run_dir, self.step)
        if not entry.published:  # a checkpoint stands for a published version (republished on resume)
            return
        t0 = time.perf_counter()
        self._checkpoint(entry.meta)
        log.info("trainer.checkpointed_at_stop", step=self.step, seconds=round(time.perf_counter() - t0, 3))

    def _publish(self, metrics: dict[str, float]) -> int:
        assert self.publisher is not None
        metrics["publish_s"] = self.publisher.publish(self.step)
        if self.ranks.rank == 0:
            t0 = time.perf_counter()
            restore.record_published(self, self.step)
            metrics["ledger_s"] = time.perf_counter() - t0
        if self.ranks.sharded and self.tc.lora is None:  # an adapter's publish is not measured (megabytes)
            metrics.update(self._publish_memory())
        return self.step

    def _publish_memory(self) -> dict[str, float]:
        """Every rank's extra memory during the publish just done, for rank 0's StepDone."""
        import torch.distributed as dist

        assert self.publisher is not None and self.publisher.memory is not None
        parts: list = [None] * self.ranks.world
        dist.all_gather_object(parts, self.publisher.memory)
        out: dict[str, float] = {}
        for m in parts:
            # Counted: arenas + gathered tensors alive at once. Measured: resident memory.
            out[f"publish_counted_bytes_rank{m.rank}"] = float(m.arena_bytes + m.gathered_peak_bytes)
            out[f"publish_gathered_peak_bytes_rank{m.rank}"] = float(m.gathered_peak_bytes)
            out[f"publish_rss_extra_bytes_rank{m.rank}"] = float(m.extra_bytes)
        out["publish_rss_extra_bytes_max"] = float(max(m.extra_bytes for m in parts))
        out["publish_bound_bytes"] = float(self.publisher.bound_bytes)
        out["publish_memory_exact"] = float(all(m.exact for m in parts))
        return out

    def _meta(self, result: StepResult) -> checkpoint.CheckpointMeta:
        def known(values: list[float]) -> list[float | None]:
            return [None if math.isnan(v) else v for v in values]

        consumption = checkpoint.Consumption(
            rollout_ids=result.rollout_ids, advantages=result.advantages,
            log_ratio_mean=known(result.log_ratio_mean), log_ratio_max_abs=known(result.log_ratio_max_abs),
            reward_mean=result.reward_mean, loss=result.loss, metrics=result.metrics)
        return checkpoint.CheckpointMeta(step=self.step, version=self.step, consumption=consumption,
                                         created_unix=time.time(), lora=self.tc.lora is not None)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close(timeout_s=WRITER_CLOSE_TIMEOUT_S)
        if self.publisher is not None:
            self.publisher.close()


def serve(client: TrainerClient, trainer: Trainer, orphaned) -> int:
    """Answer messages until Stop (0) or until the orchestrator is gone (1). Under torchrun
    (rank 0) every message, and every idle poll, is broadcast to the other ranks (`follow`)."""
    sharded = trainer.ranks.sharded
    while True:
        try:
            msg = client.recv(timeout_s=PARENT_POLL_S)
        except TrainerLinkTimeout:
            gone = orphaned()
            if sharded:
                share(ORPHANED if gone else None, trainer.ranks)
            if gone:
                log.warning("trainer.orphaned", parent_pid=orphaned.parent_pid)
                return 1
            continue
        if sharded:
            share(encode(msg), trainer.ranks)
        if isinstance(msg, Stop):
            log.info("trainer.stop", step=trainer.step)
            trainer.checkpoint_journaled()
            return 0
        if isinstance(msg, Batch):
            client.send(trainer.handle(msg))
            continue
        client.send(Failed(step=None, error=f"unexpected message {type(msg).__name__} from the orchestrator"))


def follow(trainer: Trainer) -> int:
    """A rank other than 0: handle what rank 0 received, in step with it, until Stop (0) or an
    orchestrator gone (1). Rank 0 broadcasts at least every PARENT_POLL_S, so every wait here
    is bounded by the process group's timeout."""
    while True:
        data = share(None, trainer.ranks)
        if data is None:
            continue
        if data == ORPHANED:
            log.warning("trainer.orphaned", rank=trainer.ranks.rank)
            return 1
        msg = decode(data)
        if isinstance(msg, Stop):
            log.info("trainer.stop", step=trainer.step)
            return 0
        if isinstance(msg, Batch):
            trainer.handle(msg)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator.trainer.process")
    p.add_argument("--connect", required=True, help="the orchestrator's link address, tcp://127.0.0.1:PORT "
                                                    "(only rank 0 connects)")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", required=True, help="the base model directory (version 0)")
    p.add_argument("--config-json", required=True, help="the RunConfig as JSON")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in RUN_DIR/trainer")
    p.add_argument("--orchestrator-pid", type=int, default=None,
                   help="exit when this process is gone (default: when the parent process changes)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("json")
    orphaned = Orphan(args.orchestrator_pid)
    ranks = Ranks.from_env()
    if ranks.sharded:
        import structlog

        structlog.contextvars.bind_contextvars(rank=ranks.rank)
    # Only rank 0 speaks the link; the other ranks follow it (see the module docstring).
    client = TrainerClient() if ranks.rank == 0 else None
    if client is not None:
        client.connect(args.connect)
    trainer: Trainer | None = None
    grouped = False
    together = False  # every rank ends here at the same message (Stop, or an orchestrator gone)
    try:
        config = msgspec.json.decode(args.config_json, type=RunConfig).validate()
        cpus, threads = pin(config.trainer, ranks.local_world)
        trainer_device(config.trainer, ranks)  # a "cuda" without a device fails here, naming trainer.device
        if ranks.sharded:
            init_group(ranks, config.trainer)
            grouped = True
        trainer = Trainer(args.run_dir, args.model, config, ranks)
        trainer.start(args.resume, progress=client.send if client is not None else None)
        log.info("trainer.ready", step=trainer.step, resumed=trainer.resumed, cpus=sorted(cpus),
                 threads=threads, loss=config.trainer.loss, pid=os.getpid(), world=ranks.world)
        if client is None:
            code = follow(trainer)
        else:
            client.send(trainer.ready())
            code = serve(client, trainer, orphaned)
        together = True
        return code
    except Exception as exc:
        step = trainer.current if trainer is not None else None
        log.exception("trainer.failed", step=step)
        if client is not None:
            try:
                client.send(Failed(step=step, error=f"{type(exc).__name__}: {exc}"), timeout_s=5.0)
            except Exception as lost:  # noqa: BLE001 - the orchestrator is gone; the exit code still tells
                log.warning("trainer.failed_unreported", error=str(lost))
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        if client is not None:
            client.close()
        if grouped:
            leave_group(together)


if __name__ == "__main__":
    sys.exit(main())
