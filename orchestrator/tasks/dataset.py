"""Reading a user's dataset: JSONL, Parquet, CSV, or a `datasets.Dataset.save_to_disk` directory.

Every row becomes a plain dict of its columns. Errors name the path (and the line of a JSONL
file), never a traceback: a dataset that cannot be read stops `inflight run` before any engine
starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.errors import ConfigError

SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet", ".csv": "csv"}


def load_rows(path: str | Path, where: str = "task.dataset") -> list[dict]:
    """Every row of the dataset at `path`, in file order."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(where, f"{p} does not exist")
    if p.is_dir():
        return _load_saved_dataset(p, where)
    kind = SUFFIXES.get(p.suffix.lower())
    if kind is None:
        raise ConfigError(where, f"{p}: unknown format {p.suffix!r}; use .jsonl, .parquet, .csv or a "
                                 "datasets.save_to_disk directory")
    try:
        rows = {"jsonl": _load_jsonl, "parquet": _load_parquet, "csv": _load_csv}[kind](p, where)
    except ConfigError:
        raise
    except (OSError, ValueError) as exc:
        raise ConfigError(where, f"{p}: cannot read it as {kind}: {exc}") from None
    if not rows:
        raise ConfigError(where, f"{p} holds no rows")
    return rows


def _load_jsonl(p: Path, where: str) -> list[dict]:
    rows = []
    with p.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                raise ConfigError(where, f"{p} line {number}: not valid JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ConfigError(where, f"{p} line {number}: a row must be a JSON object, got "
                                         f"{type(row).__name__}")
            rows.append(row)
    return rows


def _load_parquet(p: Path, where: str) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(p).to_pylist()


def _load_csv(p: Path, where: str) -> list[dict]:
    import pyarrow.csv as pacsv

    return pacsv.read_csv(p).to_pylist()


def _load_saved_dataset(p: Path, where: str) -> list[dict]:
    try:
        import datasets
    except ImportError:  # pragma: no cover - a dependency of this package
        raise ConfigError(where, "reading a save_to_disk directory needs the `datasets` package") from None
    try:
        loaded = datasets.load_from_disk(str(p))
    except (OSError, ValueError, FileNotFoundError) as exc:
        raise ConfigError(where, f"{p}: not a datasets.save_to_disk directory ({exc})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise ConfigError(where, f"{p} holds splits {sorted(loaded)} and no 'train'; point at one split's "
                                     "directory")
        loaded = loaded["train"]
    return rows_of(loaded, where)


def rows_of(data, where: str) -> list[dict]:
    """Rows of an in-memory dataset an entrypoint returned: a `datasets.Dataset`, a list of dicts,
    or a pandas DataFrame."""
    if hasattr(data, "to_list") and hasattr(data, "column_names"):  # datasets.Dataset
        return list(data.to_list())
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        return list(data.to_dict(orient="records"))
    if isinstance(data, (list, tuple)):
        for i, row in enumerate(data):
            if not isinstance(row, dict):
                raise ConfigError(where, f"row {i} is a {type(row).__name__}, not a dict of columns")
        return list(data)
    raise ConfigError(where, f"returned a {type(data).__name__}: expected a task object (with row()), "
                             "a datasets.Dataset, a list of dicts or a DataFrame")
