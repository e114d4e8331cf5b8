"""Whether the weights `inflight export-model` reads are weights an engine served under their
version, said plainly when they are not, or when that is not known.

* version 0 (the base model) is what every engine starts on;
* a published version (RUN_DIR/weights/vN, the files engines load) was served when the replay
  log records its activation (`activated`, or `engine_fenced`: the fleet went on without an
  engine that failed);
* a checkpoint (the published files were pruned) must also hold the weights the version was
  published with: its digest is checked against the trainer's ledger
  (`orchestrator.trainer.ledger`, RUN_DIR/trainer/published.jsonl).

A version the log records no activation of, or a checkpoint whose weights are not the ones its
version was published with, is exported all the same, with a note that names the versions the
engines did serve (the model card carries it too).
"""

from __future__ import annotations

from pathlib import Path

import msgspec

SERVED_OUTCOMES = ("activated", "engine_fenced")


class Served(msgspec.Struct, frozen=True):
    served: bool | None  # None: not known (no replay log, no ledger line)
    note: str  # "" when served


def activated_versions(run_dir: Path) -> set[int] | None:
    """The versions the replay log records as activated on the engines; None without a log."""
    if not (run_dir / "replay").is_dir():
        return None
    from replay.errors import ReplayError
    from replay.log import read_records
    from replay.records import ActivationRecord

    try:
        return {r.version for r in read_records(run_dir, lenient=True)
                if isinstance(r, ActivationRecord) and r.outcome in SERVED_OUTCOMES}
    except ReplayError:
        return None


def spans(versions: set[int]) -> str:
    """1, 2, 3, 5 -> "1-3, 5"."""
    out: list[str] = []
    for v in sorted(versions):
        if out and out[-1].split("-")[-1] == str(v - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out) or "none"


def served(run_dir: Path, version: int, kind: str, path: Path) -> Served:
    """Whether `version`, read from `path` (VersionSource kind "base", "published" or
    "checkpoint"), holds weights an engine served under that number."""
    if kind == "base":
        return Served(True, "")
    activated = activated_versions(run_dir)
    named = f" (versions the engines served: {spans(activated)})" if activated is not None else ""
    if kind == "checkpoint":
        from orchestrator.trainer import ledger

        recorded = ledger.read(run_dir).get(version)
        if recorded is None:
            return Served(None, f"version {version} is read from the checkpoint {path}, and the trainer's ledger "
                                f"({ledger.ledger_path(run_dir)}) does not record which weights version {version} was "
                                f"published with: whether an engine served these weights is not known{named}")
        held = ledger.file_digest(path)[0]
        if held != recorded:
            return Served(False, f"the checkpoint {path} holds weights no engine served: version {version} was "
                                 f"published with weights {recorded[:16]}, the checkpoint holds {held[:16]}{named}")
    if activated is None:
        return Served(None, f"{run_dir} has no replay log: whether an engine served version {version} is not known")
    if version not in activated:
        return Served(False, f"no engine served version {version}: the replay log records no activation of it{named}")
    return Served(True, "")
