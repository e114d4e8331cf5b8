"""`inflight export-model RUN_DIR [--version latest|V] OUT_DIR`: one policy version of a run as a
Hugging Face model directory (config.json, safetensors weights, the base model's tokenizer files
and chat template — the run's own, RUN_DIR/chat_template.jinja, when its task named a template
file — its generation_config.json if it has one) plus a model card (README.md) that
names the run, the version, where its weights were read, the base model and its identity hash.
`AutoModelForCausalLM.from_pretrained(OUT_DIR)` and vLLM load it.

Where a version lives (the first that holds it is used, and the card says which):

* version 0: the base model the run started from (the replay log's `run_meta` record,
  `config.model_dir`; else RUN_DIR/config.json `engine.model`);
* `published`: RUN_DIR/weights/vNNNNNNNN/ with its COMPLETE marker (the filesystem transport's
  bucket files: what the engines loaded); names are the trainer's (transformers') or, if a
  refit map wrote the engine layout, mapped back through that map's views;
* `checkpoint`: RUN_DIR/trainer/step-NNNNNNNN/model.safetensors (the trainer's checkpoint of
  step N holds version N).

A LoRA run's versions v >= 1 are adapters: exported as a PEFT adapter directory, or with
`merge=True` (`--merge`) as the base with the adapter merged in (`orchestrator.commands.export_adapter`).

The base directory must still hold what the run recorded (tokenizer and chat template hashes,
and for version 0 or an adapter the weights' hash): a changed one is an error naming what
changed. The base model is loaded with transformers, every tensor of the version is copied
into it (a name or shape that does not fit is an error naming it, as is a tensor the version
lacks), and `save_pretrained` writes the weights in checkpoint layout (a tied output head once). The
directory is written under a temporary name beside OUT_DIR and renamed into place, so a crash
leaves no half directory. Importing this module imports neither torch nor vLLM.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec

from orchestrator.errors import ConfigError, ModelError
from orchestrator.trainer.checkpoint import fsync_path

LATEST = "latest"
CARD = "README.md"
# Base-model files not copied: weights (written anew), what save_pretrained writes, the card we
# write, and the marker that says a directory was built by `inflight model init`.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")
_NOT_COPIED = {"config.json", "generation_config.json", CARD, "inflight_model.json",
               "model.safetensors.index.json", "pytorch_model.bin.index.json"}


class VersionSource(msgspec.Struct, frozen=True):
    """Where one version's weights are: `kind` "base" (the base model directory), "published"
    (a filesystem-transport version directory) or "checkpoint" (a trainer checkpoint's file)."""

    version: int
    kind: str
    path: Path


class ExportResult(msgspec.Struct, frozen=True):
    path: Path  # the exported directory
    version: int
    source: str  # "base" | "published" | "checkpoint"
    source_path: Path | None = None  # the directory or file the weights were read from
    # "model": the version's full weights; "adapter": a LoRA version's PEFT adapter directory;
    # "merged": a LoRA version merged into the base (a full model directory)
    form: str = "model"
    # Whether an engine served these weights under this version (export_served); None: not
    # known. `note` says plainly why not, or why it is not known ("" when served).
    served: bool | None = None
    note: str = ""


class RunInfo(msgspec.Struct, frozen=True):
    """What a run directory says about itself."""

    run_dir: Path
    run_id: str | None  # RUN_DIR/run_id; None: not recorded
    base_dir: Path  # version 0
    config: dict
    identity: dict | None  # the run_meta record's PolicyIdentity as recorded; None: no log
    template: str | None = None  # RUN_DIR/chat_template.jinja: the task's own template, if it had one


# -- reading the run ---------------------------------------------------------------------------


def read_run(run_dir: str | os.PathLike) -> RunInfo:
    """The run at run_dir; ConfigError("RUN_DIR", ...) when it is not one, ModelError when its
    base model directory is gone."""
    root = Path(run_dir)
    if not root.is_dir():
        raise ConfigError("RUN_DIR", f"{root} is not a directory")
    config_path = root / "config.json"
    if not config_path.is_file():
        raise ConfigError("RUN_DIR", f"{root} is not a run directory (no config.json; `inflight run` writes one)")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("RUN_DIR", f"{config_path} is unreadable: {exc}") from None
    if not isinstance(config, dict) or not isinstance(config.get("engine"), dict):
        raise ConfigError("RUN_DIR", f"{config_path} is not a run's configuration (no [engine] table)")
    run_id = (root / "run_id").read_text().strip() if (root / "run_id").is_file() else None
    meta = _run_meta(root)
    recorded = (meta.config or {}).get("model_dir") if meta is not None else None
    base = Path(recorded) if isinstance(recorded, str) and recorded else Path(str(config["engine"].get("model", "")))
    if not (base / "config.json").is_file():
        where = "the replay log's run_meta config.model_dir" if recorded else f"{config_path} engine.model"
        raise ModelError(base, f"the run's base model (from {where}) is not there: version 0 and the architecture "
                               "of every version come from it")
    identity = msgspec.to_builtins(meta.identity) if meta is not None and meta.identity is not None else None
    from orchestrator.run.recording import RUN_TEMPLATE

    template = (root / RUN_TEMPLATE).read_text() if (root / RUN_TEMPLATE).is_file() else None
    return RunInfo(run_dir=root.resolve(), run_id=run_id or None, base_dir=base.resolve(), config=config,
                   identity=identity, template=template)


def _run_meta(root: Path):
    """The log's first run_meta record, or None (no log, or none readable)."""
    if not (root / "replay").is_dir():
        return None
    from replay.errors import ReplayError
    from replay.log import read_records
    from replay.records import RunMetaRecord

    try:
        for record in read_records(root, lenient=True):
            if isinstance(record, RunMetaRecord):
                return record
    except ReplayError:
        return None
    return None


def available_versions(run: RunInfo) -> dict[int, VersionSource]:
    """Every version this run still holds, with the place it is read from (a published version
    is preferred to a checkpoint of the same step: it is what the engines loaded)."""
    from orchestrator.trainer import checkpoint

    out: dict[int, VersionSource] = {0: VersionSource(0, "base", run.base_dir)}
    for step in checkpoint.complete_steps(run.run_dir):
        path = checkpoint.checkpoint_dir(run.run_dir, step) / checkpoint.MODEL_FILE
        if path.is_file():
            try:
                version = checkpoint.read_meta(run.run_dir, step).version
            except checkpoint.CheckpointError:
                continue
            out[version] = VersionSource(version, "checkpoint", path)
    weights = run.run_dir / "weights"
    if weights.is_dir():
        for path in weights.glob("v*"):
            digits = path.name[1:]
            if digits.isdigit() and (path / "COMPLETE").is_file() and any(path.glob("*.safetensors")):
                out[int(digits)] = VersionSource(int(digits), "published", path)
    return dict(sorted(out.items()))


def resolve_version(run: RunInfo, version: int | str = LATEST) -> VersionSource:
    """`version` ("latest", an integer, "3" or "v3") among the versions the run holds."""
    available = available_versions(run)
    if isinstance(version, str) and version.strip().lower() == LATEST:
        return available[max(available)]
    number = _version_number(version)
    if number not in available:
        raise ConfigError("--version", f"version {number} is not retained in {run.run_dir} (available: "
                                       f"{', '.join(map(str, available))}; older ones are pruned by "
                                       "transport.keep_last and trainer.keep_checkpoints)")
    return available[number]


def _version_number(version: int | str) -> int:
    text = str(version).strip()
    digits = text[1:] if text[:1] in ("v", "V") else text
    if isinstance(version, bool) or not digits.isdigit():
        raise ConfigError("--version", f"must be {LATEST!r} or a version number (0 is the base model), got {version!r}")
    return int(digits)


def check_base_unchanged(run: RunInfo, source: VersionSource, adapter: bool = False) -> None:
    """The base directory still holds what the run recorded: the tokenizer and chat template
    (copied into every export; the run's own template, RUN_DIR/chat_template.jinja, where the
    task named one) and, for version 0 or an `adapter` version (which means nothing without its
    base), the weights. A hash the run did not record is not checked. ModelError names what
    changed."""
    from orchestrator.run.recording import policy_identity, weights_digest

    recorded = run.identity or {}
    now = policy_identity(run.base_dir, "", "", chat_template=run.template)
    checks = [("tokenizer", recorded.get("tokenizer_hash"), now.tokenizer_hash),
              ("chat template", recorded.get("chat_template_hash"), now.chat_template_hash)]
    base = str(recorded.get("base_checkpoint") or "")
    if (source.version == 0 or adapter) and "@sha256:" in base:
        then = base.rsplit("@sha256:", 1)[1]
        checks.append(("weights", then, weights_digest(run.base_dir)[:len(then)]))
    for what, then, current in checks:
        if then and then != current:
            raise ModelError(run.base_dir, f"its {what} changed since the run (the run recorded hash {then}, it now "
                                           f"hashes to {current}): an export would not be the run's model")


# -- writing -----------------------------------------------------------------------------------


def export_model(run_dir: str | os.PathLike, version: int | str = LATEST, *,
                 out_dir: str | os.PathLike, merge: bool = False) -> ExportResult:
    """Write `version` of the run at run_dir as a Hugging Face directory at out_dir (which must
    not exist, or be empty); a LoRA version as its adapter directory, or with `merge` merged into
    the base. Atomic: a temporary directory beside out_dir, renamed into place."""
    from orchestrator.commands.export_adapter import export_form, merged_model, read_version_adapter, write_adapter
    from orchestrator.commands.export_served import served

    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError("OUT_DIR", f"{out} exists and is not an empty directory; choose another or remove it")
    run = read_run(run_dir)
    source = resolve_version(run, version)
    form = export_form(run, source, merge)
    verdict = served(run.run_dir, source.version, source.kind, source.path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        check_base_unchanged(run, source, adapter=form != "model")
        lora = read_version_adapter(run, source) if form != "model" else None
        if form == "adapter":
            write_adapter(source, lora, tmp)
        else:
            model = merged_model(run.base_dir, lora) if lora is not None else load_version(run.base_dir, source)
            _save(model, run.base_dir, tmp, run.template)
            del model
        (tmp / CARD).write_text(model_card(run, source, tmp, out, form, lora.describe() if lora else None,
                                           verdict=verdict))
        _make_durable(tmp)
        if out.exists() and any(out.iterdir()):  # filled while we wrote: never replaced
            raise ConfigError("OUT_DIR", f"{out} was filled while the export was written")
        os.rename(tmp, out)  # an empty out_dir is replaced (POSIX rename)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ExportResult(path=out, version=source.version, source=source.kind, source_path=source.path, form=form,
                        served=verdict.served, note=verdict.note)


def load_version(base_dir: Path, source: VersionSource):
    """The base model's architecture holding `source`'s weights (transformers, eval mode)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    if source.kind == "base":
        return AutoModelForCausalLM.from_pretrained(base_dir, dtype="auto").eval()
    files = _weight_files(source)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=_stored_dtype(files) or torch.float32).eval()
    _copy_into(model, files, source)
    return model


def _weight_files(source: VersionSource) -> list[Path]:
    return [source.path] if source.path.is_file() else sorted(source.path.glob("*.safetensors"))


def _stored_dtype(files: list[Path]):
    """The dtype of the version's first floating tensor: the precision the trainer held it in."""
    import torch
    from safetensors import safe_open

    floating = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if (dtype := f.get_slice(name).get_dtype()) in floating:
                    return floating[dtype]
    return None


def _tensors(files: list[Path]) -> Iterator[tuple[str, object]]:
    """(name, tensor) of every tensor of every file, one tensor in memory at a time."""
    from safetensors import safe_open

    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _copy_into(model, files: list[Path], source: VersionSource) -> None:
    """Every tensor of the version into `model`, in place. A name the model does not hold is
    read as an engine-layout name of the model family's refit map (written through the map's
    views, the inverse of the refit); anything else that does not fit is a ModelError."""
    import torch

    own = model.state_dict()  # tensors sharing the parameters' storage
    engine_layout: dict[str, tuple[str, tuple]] | None = None
    written: set[str] = set()
    parts: dict[str, int] = {}  # trainer tensor -> engine tensors written into it
    with torch.no_grad():
        for name, tensor in _tensors(files):
            if name in own:
                target, whole = own[name], name
            else:
                if engine_layout is None:
                    engine_layout = _engine_layout(model, own)
                if name not in engine_layout:
                    raise ModelError(source.path, f"tensor {name!r} is not in the base model's architecture "
                                                  f"({type(model).__name__}): the version does not fit the base model")
                from transports.refit.views import apply_views

                src, views = engine_layout[name]
                target, whole = apply_views(own[src], views), None
                parts[src] = parts.get(src, 0) + 1
            if tuple(target.shape) != tuple(tensor.shape):
                raise ModelError(source.path, f"tensor {name!r} has shape {tuple(tensor.shape)}, the base model's "
                                              f"is {tuple(target.shape)}")
            target.copy_(tensor)
            if whole is not None:
                written.add(whole)
    if engine_layout is not None:
        expected: dict[str, int] = {}
        for src, _ in engine_layout.values():
            expected[src] = expected.get(src, 0) + 1
        written |= {src for src, n in parts.items() if n == expected[src]}
    stored = {own[n].data_ptr() for n in written}
    # A tied output head is the embedding under a second name: written when the embedding is.
    missing = sorted(n for n in own if n not in written and own[n].data_ptr() not in stored)
    if missing:
        raise ModelError(source.path, f"the version lacks {len(missing)} of the model's tensors "
                                      f"(first: {', '.join(missing[:3])})")


def _engine_layout(model, own) -> dict[str, tuple[str, tuple]]:
    """{engine name: (trainer name, views)} of the model family's refit map; {} when the family
    has none (every unknown name is then an error)."""
    from transports.errors import TransportError
    from transports.refit.families import map_for_config

    try:
        name_map = map_for_config(model.config)
    except TransportError:
        return {}
    meta = {k: (tuple(v.shape), v.dtype) for k, v in own.items()}
    return {engine: (src, tuple(views)) for engine, src, views in name_map.refit(meta)}


def _save(model, base_dir: Path, tmp: Path, template: str | None = None) -> None:
    """Weights and config from the model; tokenizer, chat template and the other small files of
    the base as they are (byte for byte: the tokenizer and template hashes stay the run's);
    generation_config.json only if the base has one. `template`: the run's own chat template,
    written as chat_template.jinja (which transformers and vLLM load before tokenizer_config's)."""
    from orchestrator.run.recording import RUN_TEMPLATE

    model.save_pretrained(tmp)
    if template is not None:
        (tmp / RUN_TEMPLATE).write_text(template)
    (tmp / "generation_config.json").unlink(missing_ok=True)
    if (base_dir / "generation_config.json").is_file():
        shutil.copyfile(base_dir / "generation_config.json", tmp / "generation_config.json")
    for path in sorted(base_dir.iterdir()):
        if (path.is_file() and not path.name.startswith(".") and path.name not in _NOT_COPIED
                and not path.name.endswith(_WEIGHT_SUFFIXES) and not (tmp / path.name).exists()):
            shutil.copyfile(path, tmp / path.name)
    from orchestrator.model import check_model_dir

    check_model_dir(tmp)  # names a missing tokenizer before the directory is published


def _make_durable(directory: Path) -> None:
    # mkdtemp makes the directory 0700: an engine may run as another user.
    directory.chmod(0o755)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o644)
            fsync_path(path)
    fsync_path(directory)


# -- the model card (README.md) ------------------------------------------------------------


def _source_words(run: RunInfo, source: VersionSource, form: str) -> str:
    if source.kind == "base":
        return f"the base model directory `{source.path}` (version 0: before any training step)"
    if source.kind == "published" and form != "model":
        return f"the published adapter `{source.path}` (the PEFT directory the engines loaded)"
    if source.kind == "published":
        return f"the published version `{source.path}` (the filesystem transport's files, which engines load)"
    return f"the trainer checkpoint `{source.path}` (the published copy of this version was pruned)"


def model_card(run: RunInfo, source: VersionSource, exported_dir: Path, shown_as: str | os.PathLike,
               form: str = "model", lora: str | None = None, verdict=None) -> str:
    """README.md: which run and version these weights are, where they were read, from which base.
    `exported_dir`: where the weights are now (hashed); `shown_as`: the path the card names;
    `form`: ExportResult.form; `lora`: the adapter's rank and alpha, for a LoRA version;
    `verdict`: export_served.Served, whether engines served these weights."""
    from orchestrator.run.recording import weights_digest

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
        ("weights read from", _source_words(run, source, form)),
        ("base model", f"`{run.base_dir}`"),
        ("base model identity", base_identity_words),
        ("this directory's weights", f"sha256 `{weights_digest(exported_dir)[:16]}` (as `inflight run` would "
                                     "record it)"),
    ]
    if verdict is not None:
        rows.append(("served by engines", {True: "yes", False: "NO: ", None: "not known: "}[verdict.served] + verdict.note))
    if lora is not None:
        rows.insert(4, ("LoRA adapter", lora + (", merged into the base" if form == "merged" else "")))
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
    if form == "model":
        front = "library_name: transformers"
        opening = f"""Policy version {source.version} of an inflight-rl run, exported by `inflight export-model`. The
tokenizer, chat template and generation settings are the base model's, copied unchanged; the
weights are the version's, in the precision the trainer held them."""
        load = f"""Load it with `AutoModelForCausalLM.from_pretrained("{shown_as}")`, or serve it with vLLM
(`LLM(model="{shown_as}")`)."""
    else:
        from orchestrator.commands.export_adapter import card_text

        front, opening, load = card_text(form, source.version, run.base_dir, str(shown_as))
    return f"""---
{front}
tags:
- inflight-rl
- reinforcement-learning
---

# {title}

{opening}

| | |
|---|---|
{table}

{load}
"""
