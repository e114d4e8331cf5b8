"""Where a run's policy versions live, read as plain safetensors.

Version 0 is the base model the run records in its `run_meta` record (`config["model_dir"]`, or
the path of `identity.base_checkpoint` for a log written before `model_dir` was recorded). A
later version v is RUN_DIR/weights/vNNNNNNNN/ when that directory holds the `COMPLETE` marker:
either the filesystem transport's layout (per-bucket `*.safetensors` files named by Hugging Face
tensor names) or, in a LoRA run, a PEFT adapter (`adapter_config.json` +
`adapter_model.safetensors`), which is merged into the base weights (`replay.analysis.adapters`).
Versions older than the transport's `keep_last` are pruned: they are reported missing, never
guessed.

One model is shared by every version. An adapter is always merged into the base weights, never
on top of another version's: the store remembers the weights a merged adapter changed and puts
them back (or reloads the base files after a full version) before the next version is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from replay.analysis import adapters
from replay.analysis.recompute import apply_state, load_model, load_state_dir

WEIGHTS_SUBDIR = "weights"
COMPLETE = "COMPLETE"


def version_dir(run_dir: str | os.PathLike[str], version: int) -> Path:
    return Path(run_dir) / WEIGHTS_SUBDIR / f"v{version:08d}"


def base_model_dir(meta) -> str | None:
    """The base model directory a `RunMetaRecord` names, or None."""
    if meta is None:
        return None
    model_dir = (meta.config or {}).get("model_dir")
    if isinstance(model_dir, str) and model_dir:
        return model_dir
    identity = meta.identity
    if identity is not None and identity.base_checkpoint:
        return identity.base_checkpoint.split("@sha256:", 1)[0]
    return None


class VersionStore:
    """The weights of each version of one run; `model(v)` loads them into one shared model.

    `base_dir` is the Hugging Face directory of version 0 (also the architecture every version
    is loaded into); `run_dir` holds the retained versions.
    """

    def __init__(self, run_dir: str | os.PathLike[str], base_dir: str | None,
                 device: str | torch.device = "cpu") -> None:
        self.run_dir = Path(run_dir)
        self.base_dir = base_dir
        self.device = device
        self._model: torch.nn.Module | None = None
        self._loaded: object = None  # the version (or directory) whose weights the model holds
        # The base values of the weights a merged adapter changed, while the model holds base +
        # that adapter (None otherwise): restoring them is restoring the base.
        self._merged: dict[str, torch.Tensor] | None = None
        self.load_seconds = 0.0

    def source(self, version: int) -> Path | None:
        """The directory holding `version`'s weights, or None when it is not available."""
        if version == 0:
            if self.base_dir and Path(self.base_dir, "config.json").is_file():
                return Path(self.base_dir)
            return None
        path = version_dir(self.run_dir, version)
        if not (path / COMPLETE).is_file():
            return None
        if adapters.is_adapter_dir(path):
            return path if (path / adapters.ADAPTER_WEIGHTS).is_file() else None
        return path if any(path.glob("*.safetensors")) else None

    def available(self, version: int) -> bool:
        return self.source(version) is not None

    def missing_reason(self, version: int) -> str:
        if version == 0:
            if not self.base_dir:
                return "the log records no base model directory (run_meta config model_dir)"
            return f"base model directory {self.base_dir} not found"
        path = version_dir(self.run_dir, version)
        if not path.exists():
            return f"{path} not found (pruned by transport.keep_last, or never published)"
        if adapters.is_adapter_dir(path):
            return f"{path} is incomplete (no {COMPLETE} marker or no {adapters.ADAPTER_WEIGHTS})"
        return f"{path} is incomplete (no {COMPLETE} marker or no safetensors files)"

    def retained(self) -> list[int]:
        """Every version whose weights are available, oldest first (0 included when found)."""
        found = [0] if self.available(0) else []
        root = self.run_dir / WEIGHTS_SUBDIR
        if root.is_dir():
            for path in root.iterdir():
                name = path.name
                if name.startswith("v") and name[1:].isdigit() and self.available(int(name[1:])):
                    found.append(int(name[1:]))
        return sorted(set(found))

    def _skeleton(self) -> torch.nn.Module:
        if self._model is None:
            if not self.base_dir or not Path(self.base_dir, "config.json").is_file():
                raise FileNotFoundError(self.missing_reason(0))
            self._model = load_model(self.base_dir, self.device)
            self._loaded = 0
        return self._model

    def model(self, version: int) -> torch.nn.Module:
        """The shared model holding `version`'s weights (FileNotFoundError if not available;
        AdapterError naming the file and tensor for an adapter that cannot be merged)."""
        import time

        model = self._skeleton()
        if self._loaded == version:
            return model
        source = self.source(version)
        if source is None:
            raise FileNotFoundError(self.missing_reason(version))
        started = time.perf_counter()
        if version == 0:
            self._restore_base(model)
        elif adapters.is_adapter_dir(source):
            self._merge_adapter(model, source)
        else:
            apply_state(model, load_state_dir(source))
            self._merged = None
        self._loaded = version
        self.load_seconds += time.perf_counter() - started
        return model

    def _restore_base(self, model: torch.nn.Module) -> None:
        """Put the base weights back: the few a merged adapter changed, or every file of the
        base after full weights (a version, a --target directory) replaced them."""
        if self._loaded == 0:
            return
        if self._merged is not None:
            adapters.restore(model.state_dict(), self._merged)
        else:
            if not self.base_dir or not Path(self.base_dir, "config.json").is_file():
                raise FileNotFoundError(self.missing_reason(0))
            apply_state(model, load_state_dir(self.base_dir))
        self._merged = None
        self._loaded = 0

    def _merge_adapter(self, model: torch.nn.Module, directory: Path) -> None:
        """Base + the adapter in `directory`. Parsed and checked before the base is restored,
        so a refused adapter leaves the model as it was."""
        adapter = adapters.read_adapter(directory)
        adapters.check_fits(adapter, {name: tuple(t.shape) for name, t in model.state_dict().items()})
        self._restore_base(model)
        self._merged = adapters.merge_into(model.state_dict(), adapter)

    def model_from_dir(self, model_dir: str | os.PathLike[str]) -> torch.nn.Module:
        """The shared model holding the weights of a Hugging Face directory (a --target MODEL_DIR):
        its safetensors are loaded into the base architecture, or the directory is loaded on its
        own when the log names no usable base. A PEFT adapter directory is merged into the base."""
        key = ("dir", os.fspath(Path(model_dir).resolve()))
        if self._loaded == key:
            return self._model  # type: ignore[return-value]
        if adapters.is_adapter_dir(model_dir):
            self._merge_adapter(self._skeleton(), Path(model_dir))
        elif self._model is None and not (self.base_dir and Path(self.base_dir, "config.json").is_file()):
            self._model = load_model(model_dir, self.device)
        else:
            apply_state(self._skeleton(), load_state_dir(model_dir))
            self._merged = None
        self._loaded = key
        return self._model  # type: ignore[return-value]
