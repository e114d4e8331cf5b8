"""`inflight export-model` of a LoRA run (`[trainer.lora]`): a version v >= 1 is an adapter.

Without `--merge` the export is a PEFT adapter directory (`adapter_model.safetensors`,
`adapter_config.json` whose `base_model_name_or_path` is the base model directory the run
used, and the model card), which `PeftModel.from_pretrained(base, OUT_DIR)` and vLLM's
`LoRARequest` load. With `--merge` it is a full Hugging Face model directory: the base with the
adapter merged in (W + (lora_alpha / r) * B @ A in fp32, cast to the base's dtype: what the
engines served) and the base's tokenizer files.

An adapter is read from the published version directory (RUN_DIR/weights/vNNNNNNNN/, the
PEFT directory the engines loaded) or, when that was pruned, from the trainer checkpoint (its
model.safetensors holds only the adapter tensors, PEFT names); the checkpoint's
adapter_config.json is then built from the run's `trainer.lora`. Version 0 is the base model:
without `--merge` it is refused (it is no adapter); with `--merge` the base is exported.

The adapter is parsed and checked against the base's architecture by
`replay.analysis.adapters` (the one implementation `inflight replay` also merges with); its
errors become `ModelError`s naming the file and the tensor.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from orchestrator.errors import ConfigError, ModelError

FORMS = ("model", "adapter", "merged")  # a full version; an adapter; an adapter merged into the base


def lora_settings(run) -> dict | None:
    """The run's `trainer.lora` table as recorded in RUN_DIR/config.json (None: not a LoRA run)."""
    lora = (run.config.get("trainer") or {}).get("lora")
    return lora if isinstance(lora, dict) else None


def is_adapter_source(source) -> bool:
    """A version stored as a LoRA adapter: a published PEFT directory, or a checkpoint whose
    tensors are adapter tensors (`.lora_A.` / `.lora_B.` in their names)."""
    from replay.analysis import adapters

    if source.kind == "published":
        return adapters.is_adapter_dir(source.path)
    if source.kind == "checkpoint":
        from safetensors import safe_open

        with safe_open(str(source.path), framework="pt") as f:
            return adapters.has_adapter_tensors(f.keys())
    return False


def export_form(run, source, merge: bool) -> str:
    """What the export writes (one of FORMS); ConfigError for version 0 of a LoRA run without
    --merge (the base model is no adapter)."""
    if is_adapter_source(source):
        return "merged" if merge else "adapter"
    if source.version == 0 and lora_settings(run) is not None and not merge:
        raise ConfigError("--version", f"version 0 of a LoRA run is the base model, not an adapter: export it "
                                       f"with --merge (a full model directory) or use {run.base_dir} itself")
    return "model"


def peft_config(run) -> dict:
    """adapter_config.json for a checkpoint's adapter, from the run's `trainer.lora`: the keys
    PEFT needs to load it. rsLoRA and DoRA are off: `trainer.lora` has no way to turn them on,
    and the engines serve plain LoRA."""
    lora = lora_settings(run)
    if lora is None:
        raise ConfigError("RUN_DIR", f"{run.run_dir / 'config.json'} has no trainer.lora, yet the checkpoint holds "
                                     "LoRA adapter tensors: the adapter's rank and alpha are unknown")
    missing = [key for key in ("rank", "alpha", "target_modules") if lora.get(key) is None]
    if missing:
        raise ConfigError("RUN_DIR", f"{run.run_dir / 'config.json'} trainer.lora lacks {', '.join(missing)}")
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(run.base_dir),
              "r": lora["rank"], "lora_alpha": lora["alpha"], "target_modules": list(lora["target_modules"]),
              "bias": "none", "use_rslora": False, "use_dora": False, "inference_mode": True}
    if lora.get("dropout") is not None:
        config["lora_dropout"] = lora["dropout"]
    return config


@dataclass(frozen=True)
class LoraVersion:
    adapter: object  # replay.analysis.adapters.Adapter
    config: dict  # adapter_config.json, naming the run's base model
    tensors: dict  # the adapter's tensors as stored (PEFT names)

    def describe(self) -> str:
        """The card's LoRA row."""
        return (f"rank {self.config['r']}, alpha {self.config['lora_alpha']} (scale {self.adapter.scale:g}), "
                f"{len(self.adapter.pairs)} weights adapted")


def read_version_adapter(run, source) -> LoraVersion:
    """An adapter version, parsed and checked against the base's architecture; ModelError
    naming the file and tensor when it is malformed or does not fit the base model."""
    from safetensors.torch import load_file

    from replay.analysis import adapters
    from replay.errors import AdapterError

    try:
        if source.kind == "published":
            weights = source.path / adapters.ADAPTER_WEIGHTS
            config = adapters.read_config(source.path / adapters.ADAPTER_CONFIG)
            config["base_model_name_or_path"] = str(run.base_dir)
            config_source = str(source.path / adapters.ADAPTER_CONFIG)
        else:
            weights, config = source.path, peft_config(run)
            config_source = f"{run.run_dir / 'config.json'} trainer.lora"
        try:
            tensors = load_file(str(weights))
        except Exception as exc:  # noqa: BLE001 - safetensors raises its own and OS errors
            raise AdapterError(str(weights), f"unreadable: {exc}") from None
        adapter = adapters.adapter_from_tensors(tensors, config, str(weights), config_source)
        adapters.check_fits(adapter, _base_shapes(run.base_dir))
    except AdapterError as exc:
        raise ModelError(exc.file, str(exc).removeprefix(f"adapter {exc.file}: ")) from None
    return LoraVersion(adapter, config, tensors)


def _base_shapes(base_dir: Path) -> dict[str, tuple[int, ...]]:
    """The base architecture's tensor shapes, from its config alone (no weights read)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base_dir))
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def write_adapter(source, lora: LoraVersion, tmp: Path) -> None:
    """The PEFT adapter directory of `source` into tmp: a published adapter's tensors byte for
    byte, a checkpoint's re-saved under the same names; the config names the run's base."""
    from safetensors.torch import save_file

    from replay.analysis import adapters

    if source.kind == "published":
        shutil.copyfile(source.path / adapters.ADAPTER_WEIGHTS, tmp / adapters.ADAPTER_WEIGHTS)
    else:
        save_file({k: v.contiguous() for k, v in lora.tensors.items()}, str(tmp / adapters.ADAPTER_WEIGHTS),
                  metadata={"format": "pt"})
    (tmp / adapters.ADAPTER_CONFIG).write_text(json.dumps(lora.config, indent=2, sort_keys=True) + "\n")


def merged_model(base_dir: Path, lora: LoraVersion):
    """The base model (in its own dtype) with the adapter merged into its weights."""
    import transformers
    from transformers import AutoModelForCausalLM

    from replay.analysis import adapters

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto").eval()
    adapters.merge_into(model.state_dict(), lora.adapter)
    return model


def card_text(form: str, version: int, base_dir: Path, shown_as: str) -> tuple[str, str, str]:
    """(front-matter lines, opening paragraph, how to load) of the model card of an adapter or
    merged export."""
    if form == "merged":
        return ("library_name: transformers", f"""Policy version {version} of an inflight-rl LoRA run: the run's
adapter merged into the base model (W + (lora_alpha / r) * B @ A, computed in fp32, in the base's
precision), exported by `inflight export-model --merge`. The tokenizer, chat template and
generation settings are the base model's, copied unchanged.""",
                f"""Load it with `AutoModelForCausalLM.from_pretrained("{shown_as}")`, or serve it with vLLM
(`LLM(model="{shown_as}")`).""")
    return (f"library_name: peft\nbase_model: {base_dir}", f"""The LoRA adapter of policy version {version} of an
inflight-rl run, exported by `inflight export-model`: apply it to the base model named below
(`adapter_config.json` names it in `base_model_name_or_path`).""",
            f"""Load it with `PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained("{base_dir}"),
"{shown_as}")`, or serve it with vLLM (`LLM(model="{base_dir}", enable_lora=True)` and
`LoRARequest("v{version}", 1, "{shown_as}")`); `--merge` writes a full model directory instead.""")

