"""The model card (README.md) that `inflight export-model` writes beside the weights: which run
and version the weights are, where they were read, the base model and its identity hash."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from orchestrator.export_model import RunInfo, VersionSource


def _source_words(run: RunInfo, source: VersionSource) -> str:
    if source.kind == "base":
        return f"the base model directory `{source.path}` (version 0: before any training step)"
    if source.kind == "published":
        return f"the published version `{source.path}` (the filesystem transport's files, which engines load)"
    return f"the trainer checkpoint `{source.path}` (the published copy of this version was pruned)"


def model_card(run: RunInfo, source: VersionSource, exported_dir: Path, shown_as: str | os.PathLike) -> str:
    """README.md: which run and version these weights are, where they were read, from which base.
    `exported_dir`: where the weights are now (hashed); `shown_as`: the path the card names."""
    from orchestrator.recording import weights_digest

    identity = run.identity or {}
    base_identity = identity.get("base_checkpoint")
    if base_identity:
        base_identity_words = f"`{base_identity}` (recorded by the run in its replay log)"
    else:
        base_identity_words = (f"`{run.base_dir}@sha256:{weights_digest(run.base_dir)[:16]}` (computed at export: "
                               "the run's log records none)")
    rows = [
        ("run id", f"`{run.run_id}`" if run.run_id else "not recorded (no RUN_DIR/run_id)"),
        ("run directory", f"`{run.run_dir}`"),
        ("policy version", f"{source.version}" + (" (the base model)" if source.version == 0
                                                  else f" (after trainer step {source.version})")),
        ("weights read from", _source_words(run, source)),
        ("base model", f"`{run.base_dir}`"),
        ("base model identity", base_identity_words),
        ("this directory's weights", f"sha256 `{weights_digest(exported_dir)[:16]}` (as `inflight run` would "
                                     "record it)"),
    ]
    for key, label in (("tokenizer_hash", "tokenizer hash"), ("chat_template_hash", "chat template hash"),
                       ("serving_precision", "serving precision"), ("logprobs_mode", "logprobs mode")):
        if identity.get(key):
            rows.append((label, f"`{identity[key]}`"))
    task = {k: v for k, v in (run.config.get("task") or {}).items() if k in ("name", "dataset", "entrypoint", "id")
            and v is not None}
    if task:
        rows.append(("task", ", ".join(f"{k} `{v}`" for k, v in task.items())))
    rows.append(("exported", time.strftime("%Y-%m-%d %H:%M:%S %Z")))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    title = f"version {source.version} of run {run.run_id}" if run.run_id else f"version {source.version}"
    return f"""---
library_name: transformers
tags:
- inflight-rl
- reinforcement-learning
---

# {title}

Policy version {source.version} of an inflight-rl run, exported by `inflight export-model`. The
tokenizer, chat template and generation settings are the base model's, copied unchanged; the
weights are the version's, in the precision the trainer held them.

| | |
|---|---|
{table}

Load it with `AutoModelForCausalLM.from_pretrained("{shown_as}")`, or serve it with vLLM
(`LLM(model="{shown_as}")`).
"""
