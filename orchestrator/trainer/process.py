"""The trainer process: `python -m orchestrator.trainer.process --connect ADDR --run-dir DIR
--model MODEL_DIR --config-json JSON [--resume]`.

It connects to the orchestrator's link (`orchestrator.trainer.link`), says `Ready`, then for
each `Batch(step=s)`: one optimizer step from version s-1; when s % publish_every == 0 it
checkpoints (first) and publishes version s (then), and answers `StepDone`. `Stop` ends it
(exit 0); an exception answers `Failed` and exits 1; so does an orchestrator that went away
(the parent pid changed).

Ranks: only rank 0 (env RANK unset or "0") opens the link. A multi-rank training step
(WORLD_SIZE > 1) is not implemented: it needs a torch.distributed process group, gradient
all-reduce (DDP/FSDP wrapping) and rank-0-only publishing and checkpointing; the process
refuses it at start-up.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

import msgspec
import numpy as np
import torch

from orchestrator.config import RunConfig, TrainerConfig
from orchestrator.logging import configure_logging, get_logger
from orchestrator.trainer import checkpoint
from orchestrator.trainer.link import (
    Batch,
    Failed,
    Ready,
    Sample,
    StepDone,
    Stop,
    TrainerClient,
    TrainerLinkTimeout,
    pack_f32,
    unpack_f32,
    unpack_i32,
)
from orchestrator.trainer.loss import (
    PackedBatch,
    completion_logprobs,
    group_advantages,
    per_rollout_log_ratio,
    policy_loss,
)
from orchestrator.trainer.publish import Publisher

log = get_logger("orchestrator.trainer")

# How often the idle trainer checks that its orchestrator (the parent process) still exists.
PARENT_POLL_S = 1.0


class StepResult(msgspec.Struct):
    loss: float
    reward_mean: float
    metrics: dict[str, float]
    rollout_ids: list[int]
    advantages: list[float]
    log_ratio_mean: list[float]  # NaN: a rollout without completion tokens
    log_ratio_max_abs: list[float]


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample],
               config: TrainerConfig, pad_id: int, step: int | None = None,
               temperature: float = 1.0) -> StepResult:
    """One optimizer step on one batch of samples (pure compute: no I/O)."""
    if not samples:
        raise ValueError("a batch needs at least one sample")
    prompts = [unpack_i32(s.prompt_token_ids).tolist() for s in samples]
    completions = [unpack_i32(s.completion_token_ids).tolist() for s in samples]
    recorded = [unpack_f32(s.logprobs) for s in samples]
    for s, c, lp in zip(samples, completions, recorded):
        if len(c) != len(lp):
            raise ValueError(f"rollout {s.rollout_id}: {len(c)} completion tokens but {len(lp)} logprobs")
    behaviour = torch.from_numpy(np.concatenate(recorded).astype(np.float32))
    batch = PackedBatch(prompts, completions, pad_id)
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    advantages = group_advantages(rewards, torch.tensor([s.group_id for s in samples]), config.normalize_std)

    optimizer.zero_grad(set_to_none=True)
    logp = completion_logprobs(model, batch, temperature)
    # One forward serves both: the weights have not moved yet, so logp.detach() is the trainer's
    # logprob before the step (no dropout in these models: train and inference forwards agree).
    lr_mean, lr_max = per_rollout_log_ratio(logp.detach() - behaviour, batch.flat_rollout, len(samples))
    loss, stats = policy_loss(logp, behaviour, advantages[batch.flat_rollout], None, config)
    loss.backward()
    max_norm = config.grad_clip if config.grad_clip > 0 else math.inf
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()

    metrics = {**stats, "grad_norm": float(grad_norm), "samples": float(len(samples))}
    if step is not None:
        # Staleness of a sample consumed by step s: (s - 1) - its dispatched version.
        lags = [(step - 1) - s.dispatched_version for s in samples]
        metrics.update(staleness_mean=float(np.mean(lags)), staleness_max=float(max(lags)))
    return StepResult(loss=float(loss.detach()), reward_mean=float(rewards.mean()), metrics=metrics,
                      rollout_ids=[s.rollout_id for s in samples], advantages=advantages.tolist(),
                      log_ratio_mean=lr_mean.tolist(), log_ratio_max_abs=lr_max.tolist())


class Trainer:
    """The trainer's state between messages: model, optimizer, step, publisher."""

    def __init__(self, run_dir: str, model_dir: str, config: RunConfig) -> None:
        import transformers
        from transformers import AutoModelForCausalLM

        # stderr carries JSON lines only: no progress bars, no advisory warnings.
        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()
        self.run_dir = run_dir
        self.config = config
        self.tc = config.trainer
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.model.eval()  # no dropout; the gradient does not depend on the mode
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=self.tc.lr, weight_decay=self.tc.weight_decay)
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0  # padding is masked out: any id will do
        self.step = 0
        self.current: int | None = None  # the step being trained (named by Failed if it raises)
        self.resumed = False
        self.publisher: Publisher | None = None

    def start(self, resume: bool) -> None:
        """Restore the newest checkpoint (with --resume), repair its version, open the publisher."""
        steps = checkpoint.complete_steps(self.run_dir)
        if steps and not resume:
            raise RuntimeError(f"{checkpoint.checkpoints_root(self.run_dir)} holds checkpoints up to step {steps[-1]}: "
                               "start with --resume, or use a new run directory")
        if resume and steps:
            checkpoint.load(self.run_dir, steps[-1], self.model, self.optimizer)
            self.step, self.resumed = steps[-1], True
        self.publisher = Publisher(self.model, self.run_dir, self.config.transport, version=self.step)
        newer = [v for v in self.publisher.published() if v > self.step]
        if newer:
            raise RuntimeError(f"{self.publisher.root} holds version {newer[-1]} but the trainer starts at step "
                               f"{self.step}: continuing would publish other weights under the same number")
        if self.step > 0 and not self.publisher.is_complete(self.step):
            # Crashed between checkpoint and publish: the checkpoint holds exactly these weights.
            seconds = self.publisher.publish(self.step)
            log.info("trainer.republished", version=self.step, seconds=round(seconds, 4))

    def ready(self) -> Ready:
        assert self.publisher is not None
        return Ready(step=self.step, version=self.step, plan_json=self.publisher.plan_json,
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
        result = train_step(self.model, self.optimizer, batch.samples, self.tc, self.pad_id, step=batch.step,
                            temperature=self.config.sampling.temperature)
        self.step = batch.step
        metrics = dict(result.metrics, train_s=time.perf_counter() - started)
        version = None
        if self.step % self.tc.publish_every == 0:
            version = self._persist(result, metrics)
        seconds = time.perf_counter() - started
        log.info("trainer.step", step=self.step, version=version, loss=result.loss, reward_mean=result.reward_mean,
                 seconds=round(seconds, 4))
        return StepDone(step=self.step, version=version, loss=result.loss, reward_mean=result.reward_mean,
                        metrics=metrics, seconds=seconds, rollout_ids=result.rollout_ids,
                        advantages=pack_f32(result.advantages), log_ratio_mean=pack_f32(result.log_ratio_mean),
                        log_ratio_max_abs=pack_f32(result.log_ratio_max_abs))

    def _persist(self, result: StepResult, metrics: dict[str, float]) -> int:
        """Checkpoint first, then publish: see checkpoint.py for why the order matters."""
        assert self.publisher is not None
        if self.tc.checkpoint:
            t0 = time.perf_counter()
            checkpoint.save(self.run_dir, self.model, self.optimizer, self._meta(result), self.tc.keep_checkpoints)
            metrics["checkpoint_s"] = time.perf_counter() - t0
        metrics["publish_s"] = self.publisher.publish(self.step)
        return self.step

    def _meta(self, result: StepResult) -> checkpoint.CheckpointMeta:
        def known(values: list[float]) -> list[float | None]:
            return [None if math.isnan(v) else v for v in values]

        consumption = checkpoint.Consumption(
            rollout_ids=result.rollout_ids, advantages=result.advantages,
            log_ratio_mean=known(result.log_ratio_mean), log_ratio_max_abs=known(result.log_ratio_max_abs),
            reward_mean=result.reward_mean, loss=result.loss, metrics=result.metrics)
        return checkpoint.CheckpointMeta(step=self.step, version=self.step, consumption=consumption,
                                         created_unix=time.time())

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()


def pin(tc: TrainerConfig) -> set[int]:
    """Keep the trainer off the engine's core (vLLM's CPU worker pins itself to core 0)."""
    available = os.sched_getaffinity(0)
    cpus = set(tc.cpus) if tc.cpus else (available - {0}) or available
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    return cpus


def check_world() -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        raise RuntimeError(f"WORLD_SIZE={world}: a multi-rank training step is not implemented (it needs a "
                           "torch.distributed process group, gradient all-reduce via DDP/FSDP, and rank-0-only "
                           "publishing and checkpointing); run one trainer process")


def serve(client: TrainerClient, trainer: Trainer, parent_pid: int) -> int:
    """Answer messages until Stop (0) or until the orchestrator is gone (1)."""
    while True:
        try:
            msg = client.recv(timeout_s=PARENT_POLL_S)
        except TrainerLinkTimeout:
            if os.getppid() != parent_pid:
                log.warning("trainer.orphaned", parent_pid=parent_pid)
                return 1
            continue
        if isinstance(msg, Stop):
            log.info("trainer.stop", step=trainer.step)
            return 0
        if isinstance(msg, Batch):
            client.send(trainer.handle(msg))
            continue
        client.send(Failed(step=None, error=f"unexpected message {type(msg).__name__} from the orchestrator"))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m orchestrator.trainer.process")
    p.add_argument("--connect", required=True, help="the orchestrator's link address, tcp://127.0.0.1:PORT")
    p.add_argument("--run-dir", required=True)
    p.add_argument("--model", required=True, help="the base model directory (version 0)")
    p.add_argument("--config-json", required=True, help="the RunConfig as JSON")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in RUN_DIR/trainer")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("json")
    parent_pid = os.getppid()
    rank = os.environ.get("RANK")
    # Only rank 0 speaks the link (a torchrun trainer's other ranks would follow rank 0).
    client = TrainerClient() if rank in (None, "0") else None
    if client is not None:
        client.connect(args.connect)
    trainer: Trainer | None = None
    try:
        check_world()
        config = msgspec.json.decode(args.config_json, type=RunConfig).validate()
        cpus = pin(config.trainer)
        trainer = Trainer(args.run_dir, args.model, config)
        trainer.start(args.resume)
        log.info("trainer.ready", step=trainer.step, resumed=trainer.resumed, cpus=sorted(cpus),
                 threads=config.trainer.threads, loss=config.trainer.loss, pid=os.getpid())
        if client is None:
            return 0
        client.send(trainer.ready())
        return serve(client, trainer, parent_pid)
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


if __name__ == "__main__":
    sys.exit(main())
