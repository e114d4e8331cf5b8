"""Experiment tracking: TensorBoard event files and Weights & Biases, under the field's names.

    reward/mean  reward/<component>  staleness/mean  staleness/max  mismatch/kl  loss
    timing/step_s  timing/pause_s  throughput/tokens_per_s  eval/<task>/pass@k  eval/<task>/mean@k
    trainer/<metric>   everything else the trainer reported for the step

Steps are trainer steps. W&B drops a point logged at a step older than one already logged, so
activations and evaluations are logged at the newest trainer step seen.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from orchestrator.errors import ConfigError
from orchestrator.observe.logging import get_logger

log = get_logger(__name__)


class Tracking:
    def __init__(self, run_dir: Path, config, run_id: str) -> None:
        self._tb = None
        self._wandb = None
        self.step = 0
        if config.run.tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        wandb_config = config.run.wandb_settings()
        if wandb_config is not None:
            try:
                import wandb
            except ImportError:
                raise ConfigError("run.wandb", "Weights & Biases is not installed: pip install wandb "
                                               "(or leave run.wandb unset)") from None
            # resume="allow" continues the same W&B run after --resume online; offline, W&B 0.31
            # writes nothing at all with it (measured), so a resumed offline run gets a new
            # offline directory under the same id, which `wandb sync` joins.
            resume = "allow" if wandb_config.mode == "online" else None
            self._wandb = wandb.init(project=wandb_config.project, mode=wandb_config.mode, dir=str(run_dir),
                                     id=run_id, name=wandb_config.name, resume=resume,
                                     config=msgspec.to_builtins(config), settings=wandb.Settings(
                                         console="off", silent=True))

    def log(self, scalars: dict[str, float | None], step: int | None = None) -> None:
        """Log the known values (None: not measured, left out) at `step` (default: the newest)."""
        if step is not None:
            self.step = max(self.step, step)
        values = {k: float(v) for k, v in scalars.items() if v is not None}
        if not values:
            return
        if self._tb is not None:
            for name, value in values.items():
                self._tb.add_scalar(name, value, self.step)
        if self._wandb is not None:
            self._wandb.log(values, step=self.step)

    def step_done(self, m, staleness: list[int], components: dict[str, float], tokens_per_s: float | None) -> None:
        metrics = dict(m.metrics)
        scalars = {"reward/mean": m.reward_mean, "loss": m.loss, "staleness/mean": sum(staleness) / len(staleness),
                   "staleness/max": max(staleness), "timing/step_s": m.seconds,
                   "mismatch/kl": metrics.get("kl_k3"), "throughput/tokens_per_s": tokens_per_s,
                   **{f"reward/{name}": value for name, value in components.items()},
                   **{f"trainer/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}}
        self.log(scalars, step=m.step)

    def activation(self, record) -> None:
        pauses = [eo.pause_s for eo in record.engines if eo.pause_s is not None]
        scalars = {f"activation/pause_s/{eo.engine}": eo.pause_s for eo in record.engines}
        scalars |= {f"activation/transfer_s/{eo.engine}": eo.transfer_s for eo in record.engines}
        scalars["timing/pause_s"] = max(pauses) if pauses else None
        self.log(scalars)

    def evaluation(self, record) -> None:
        prefix = f"eval/{record.task}"
        self.log({f"{prefix}/pass@{record.k}": record.pass_at_k, f"{prefix}/mean@{record.k}": record.mean_at_k,
                  **{f"{prefix}/{name}": value for name, value in record.components.items()}})

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as exc:  # noqa: BLE001 - tracking must never fail the run's teardown
                log.warning("wandb.finish_failed", error=str(exc))
