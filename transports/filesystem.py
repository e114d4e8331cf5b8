"""Filesystem transport: one safetensors file per bucket and a manifest, per version directory.

Layout under `root`:

    v00000012/                      a published version (atomic rename of a temporary dir)
        bucket-00000.safetensors    the tensors of bucket 0, loadable by any safetensors reader
        manifest.json               names, shapes, dtypes, byte offsets and checksums (msgspec)
        COMPLETE                    written last: a reader trusts only versions that have it
    .tmp-v00000013-<pid>/           a version being written

The last `keep_last` versions are retained (replay analysis reads them); older ones are removed.
Always available; the default transport when a LoRA adapter is trained.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch

from transports.base import BucketHeader, MissingTensorError, TensorMeta, TransportError, TransportTimeoutError
from transports.staging import ReplayPipeline, StagingArea

log = structlog.get_logger("transports.filesystem")

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
              "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


class BucketFile(msgspec.Struct, frozen=True):
    file: str
    nbytes: int  # file size
    tensors: tuple[TensorMeta, ...]  # offsets relative to the start of the file


class Manifest(msgspec.Struct, frozen=True):
    version: int
    bucket_count: int
    buckets: tuple[BucketFile, ...]
    checksums: bool
    created_unix: float
    kv_scales: dict[str, float] | None = None


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def published_versions(root: Path) -> list[int]:
    """Complete versions under `root`, oldest first."""
    out = []
    for path in root.glob("v*"):
        if path.is_dir() and (path / COMPLETE).exists() and path.name[1:].isdigit():
            out.append(int(path.name[1:]))
    return sorted(out)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _safetensors_header(metas: tuple[TensorMeta, ...]) -> tuple[bytes, list[tuple[int, int]]]:
    """The safetensors header for tensors written back to back; returns it (8-byte length
    prefix included, padded to 8 bytes) and each tensor's (start, end) in the data section."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    spans, cursor = [], 0
    for meta in metas:
        spans.append((cursor, cursor + meta.nbytes))
        header[meta.name] = {"dtype": _ST_DTYPES[meta.dtype], "shape": list(meta.shape),
                             "data_offsets": [cursor, cursor + meta.nbytes]}
        cursor += meta.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, spans


class FilesystemSender:
    def __init__(self, root: str | os.PathLike, *, keep_last: int = 3, fsync: bool = True):
        self.root = Path(root)
        self.keep_last = max(1, keep_last)
        self.fsync = fsync
        self._tmp: Path | None = None
        self._files: list[BucketFile] = []
        self._kv_scales: dict[str, float] | None = None
        self._checksums = True

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        return {"root": str(self.root)}

    def connect(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def begin(self, version: int, bucket_count: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        # A retried version replaces the failed attempt; readers must not see the old one.
        shutil.rmtree(version_dir(self.root, version), ignore_errors=True)
        self._tmp = self.root / f".tmp-v{version:08d}-{os.getpid()}"
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir()
        self._files = []
        self._kv_scales = None

    def send(self, header: BucketHeader, payload: memoryview) -> None:
        assert self._tmp is not None, "begin() first"
        prefix, spans = _safetensors_header(header.tensors)
        name = f"bucket-{header.index:05d}.safetensors"
        chunks = [prefix] + [payload[m.offset:m.offset + m.nbytes] for m in header.tensors]
        with open(self._tmp / name, "wb", buffering=0) as f:
            for chunk in chunks:
                f.write(chunk)
            if self.fsync:
                os.fsync(f.fileno())
        base = len(prefix)
        metas = tuple(msgspec.structs.replace(m, offset=base + s) for m, (s, _) in zip(header.tensors, spans))
        self._files.append(BucketFile(name, base + (spans[-1][1] if spans else 0), metas))
        self._checksums = header.checksums
        if header.kv_scales is not None:
            self._kv_scales = dict(header.kv_scales)

    def commit(self, version: int) -> None:
        assert self._tmp is not None, "begin() first"
        manifest = Manifest(version, len(self._files), tuple(self._files), self._checksums, time.time(), self._kv_scales)
        with open(self._tmp / MANIFEST, "wb") as f:
            f.write(msgspec.json.encode(manifest))
            if self.fsync:
                os.fsync(f.fileno())
        final = version_dir(self.root, version)
        shutil.rmtree(final, ignore_errors=True)
        os.rename(self._tmp, final)  # atomic: readers see the whole directory or none of it
        with open(final / COMPLETE, "wb") as f:
            if self.fsync:
                os.fsync(f.fileno())
        if self.fsync:
            _fsync_dir(final)
            _fsync_dir(self.root)
        self._tmp = None
        self._prune(version)
        log.info("filesystem.published", version=version, buckets=len(self._files), path=str(final))

    def _prune(self, newest: int) -> None:
        versions = published_versions(self.root)
        for old in versions[:-self.keep_last]:
            shutil.rmtree(version_dir(self.root, old), ignore_errors=True)

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


class FilesystemReceiver:
    """Waits for a version's completion marker, then reads bucket k+1 while bucket k replays."""

    def __init__(self, root: str | os.PathLike, *, arena_bytes: int, timeout_s: float = 60.0,
                 poll_s: float = 0.01):
        self.root = Path(root)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        self._arenas = [torch.empty(max(arena_bytes, 1) + 4096, dtype=torch.uint8) for _ in range(2)]

    def _wait_published(self, version: int) -> Path:
        path = version_dir(self.root, version)
        deadline = time.monotonic() + self.timeout_s
        delay = self.poll_s
        while not (path / COMPLETE).exists():
            if time.monotonic() > deadline:
                raise TransportTimeoutError(f"waiting for version {version} under {self.root}", self.timeout_s)
            time.sleep(delay)
            delay = min(delay * 2, 0.2)
        return path

    def receive(self, version: int, staging: StagingArea) -> None:
        path = self._wait_published(version)
        try:
            manifest = msgspec.json.decode((path / MANIFEST).read_bytes(), type=Manifest)
        except (OSError, msgspec.DecodeError) as exc:
            raise TransportError(f"version {version}: unreadable manifest: {exc}") from exc
        pipe = ReplayPipeline(staging, arenas=2, timeout_s=self.timeout_s)
        try:
            for k, bucket in enumerate(manifest.buckets):
                slot = pipe.acquire(k)
                payload = self._read(path / bucket.file, self._arenas[slot], bucket)
                header = BucketHeader(manifest.version, k, manifest.bucket_count, len(payload), bucket.tensors,
                                      manifest.checksums, manifest.kv_scales if k == 0 else None)
                pipe.submit(slot, header, payload)
            pipe.drain()
        finally:
            pipe.close()

    def _read(self, file: Path, arena: torch.Tensor, bucket: BucketFile) -> memoryview:
        """Reads the file into the arena. A short file yields a short payload, which staging
        reports as a truncated bucket naming the first tensor cut off."""
        view = memoryview(arena.numpy())
        if bucket.nbytes > len(view):
            raise TransportError(f"{file.name}: {bucket.nbytes} bytes exceed the arena ({len(view)})")
        try:
            with open(file, "rb", buffering=0) as f:
                got = 0
                while got < bucket.nbytes:
                    n = f.readinto(view[got:bucket.nbytes])
                    if not n:
                        break
                    got += n
        except FileNotFoundError as exc:
            first = bucket.tensors[0].name if bucket.tensors else file.name
            raise MissingTensorError(first, f"bucket file {file.name} is missing") from exc
        return view[:got]

    def close(self) -> None:
        pass
