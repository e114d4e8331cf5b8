"""Filesystem transport: one safetensors file per bucket and a manifest, per version directory.

Layout under `root`:

    v00000012/                      a published version (atomic rename of the temporary dir)
        bucket-00000.safetensors    the tensors of bucket 0, loadable by any safetensors reader
        manifest.json               names, shapes, dtypes, byte offsets and checksums (msgspec)
        COMPLETE                    written last, after every file is fsynced: a reader that
                                    wants a durable version trusts only those with it
    .tmp-v00000013/                 the version being written
        bucket-00000.safetensors    each bucket appears (renamed from `.part`) once fully written

Every bucket file is self-describing: its safetensors `__metadata__["inflight"]` holds the
bucket header (version, attempt, index, count, checksums, kv_scales), so an engine streams a
version while it is written: it reads bucket k (from the temporary dir, or from the published
one if the rename already happened) as soon as it appears, while the trainer writes bucket
k+1 and a background thread fsyncs bucket k-1. The engine only *stages* what it reads; the
version goes live after the trainer's `commit()` (every fsync, manifest, rename, `COMPLETE`)
returned. A bucket left over from an abandoned attempt is never read: `begin()` removes the
version's directories before any engine starts waiting, and each file names its attempt.
`FilesystemReceiver.receive(..., committed=True)` (what `transports.swap` stages with) also waits,
bounded, for `COMPLETE` and checks that the committed files are the ones it read;
`committed_attempt(v)` says which attempt a committed version holds.

The last `keep_last` versions are retained (replay analysis reads them); older ones are removed.
Always available; the default transport when a LoRA adapter is trained.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import structlog
import torch

from transports.errors import MissingTensorError, TransportError, TransportTimeoutError
from transports.staging import ReplayPipeline, StagingArea
from transports.wire import BucketHeader, TensorMeta

log = structlog.get_logger("transports.filesystem")

COMPLETE = "COMPLETE"
MANIFEST = "manifest.json"
META_KEY = "inflight"  # the bucket header inside a file's safetensors __metadata__

_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
              "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_TORCH_DTYPES = {v: k for k, v in _ST_DTYPES.items()}


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
    attempt: int | None = None  # which try at sending this version was committed (None: an older writer)


class FileMeta(msgspec.Struct, frozen=True):
    """The bucket header carried in each file's `__metadata__` (as a JSON string)."""

    version: int
    index: int
    count: int
    attempt: int
    checksums: bool
    crc: dict[str, int]
    kv_scales: dict[str, float] | None = None


def version_dir(root: Path, version: int) -> Path:
    return root / f"v{version:08d}"


def partial_dir(root: Path, version: int) -> Path:
    return root / f".tmp-v{version:08d}"


def bucket_name(index: int) -> str:
    return f"bucket-{index:05d}.safetensors"


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


def _safetensors_header(metas: tuple[TensorMeta, ...], meta: FileMeta | None = None) -> tuple[bytes, list[tuple[int, int]]]:
    """The safetensors header for tensors written back to back; returns it (8-byte length
    prefix included, padded to 8 bytes) and each tensor's (start, end) in the data section."""
    info: dict[str, str] = {"format": "pt"}
    if meta is not None:
        info[META_KEY] = msgspec.json.encode(meta).decode()
    header: dict[str, Any] = {"__metadata__": info}
    spans, cursor = [], 0
    for m in metas:
        spans.append((cursor, cursor + m.nbytes))
        header[m.name] = {"dtype": _ST_DTYPES[m.dtype], "shape": list(m.shape),
                          "data_offsets": [cursor, cursor + m.nbytes]}
        cursor += m.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, spans


def parse_bucket_file(data: memoryview) -> tuple[FileMeta, tuple[TensorMeta, ...]]:
    """The bucket header of a file written by `FilesystemSender` (offsets from the file start).
    A file cut inside its header raises `TransportError`; one cut in its data parses, and
    staging names the first tensor cut off."""
    if len(data) < 8:
        raise TransportError(f"bucket file of {len(data)} bytes has no safetensors header")
    size = int.from_bytes(data[:8], "little")
    if 8 + size > len(data):
        raise TransportError(f"bucket file of {len(data)} bytes is cut inside its {size}-byte header")
    try:
        header = json.loads(bytes(data[8:8 + size]))
        meta = msgspec.json.decode(header["__metadata__"][META_KEY], type=FileMeta)
    except (ValueError, KeyError, TypeError, msgspec.DecodeError) as exc:
        raise TransportError(f"bucket file without an inflight header: {exc}") from exc
    base = 8 + size
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        tensors.append(TensorMeta(name, tuple(entry["shape"]), _TORCH_DTYPES.get(entry["dtype"], entry["dtype"]),
                                  base + start, end - start, meta.crc.get(name, 0)))
    return meta, tuple(tensors)


def read_bucket_meta(path: Path) -> FileMeta:
    """The bucket header of one bucket file, reading only its safetensors header."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        size = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        meta, _ = parse_bucket_file(memoryview(prefix + f.read(size)))
    return meta


class FilesystemSender:
    """Writes each bucket as it is packed; a background thread fsyncs bucket k while bucket k+1
    is written. `commit()` waits for every fsync, then publishes the version atomically."""

    def __init__(self, root: str | os.PathLike, *, keep_last: int = 3, fsync: bool = True):
        self.root = Path(root)
        self.keep_last = max(1, keep_last)
        self.fsync = fsync
        self._tmp: Path | None = None
        self._files: list[BucketFile] = []
        self._kv_scales: dict[str, float] | None = None
        self._checksums = True
        self._attempt: int | None = None
        self._syncer: ThreadPoolExecutor | None = None
        self._syncing: list[Future] = []

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        return {"root": str(self.root)}

    def connect(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def begin(self, version: int, bucket_count: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self._wait_synced()
        # A retried version replaces the failed attempt; readers must not see the old one.
        # This runs before any engine starts waiting for the version.
        shutil.rmtree(version_dir(self.root, version), ignore_errors=True)
        self._tmp = partial_dir(self.root, version)
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._tmp.mkdir()
        self._files = []
        self._kv_scales = None
        self._attempt = None

    def send(self, header: BucketHeader, payload: memoryview) -> None:
        assert self._tmp is not None, "begin() first"
        meta = FileMeta(header.version, header.index, header.count, header.attempt, header.checksums,
                        {m.name: m.checksum for m in header.tensors}, header.kv_scales)
        prefix, spans = _safetensors_header(header.tensors, meta)
        name = bucket_name(header.index)
        part = self._tmp / (name + ".part")
        chunks = [prefix] + [payload[m.offset:m.offset + m.nbytes] for m in header.tensors]
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            _write_all(fd, chunks)
            os.rename(part, self._tmp / name)  # the engine may read it from now on
        except BaseException:
            os.close(fd)
            raise
        if self.fsync:
            self._background(_fsync_close, fd)
        else:
            os.close(fd)
        base = len(prefix)
        metas = tuple(msgspec.structs.replace(m, offset=base + s) for m, (s, _) in zip(header.tensors, spans))
        self._files.append(BucketFile(name, base + (spans[-1][1] if spans else 0), metas))
        self._checksums = header.checksums
        self._attempt = header.attempt
        if header.kv_scales is not None:
            self._kv_scales = dict(header.kv_scales)

    def _background(self, fn, *args) -> None:
        """Runs `fn` on the sender's one background thread (fsyncs, pruning), in order."""
        if self._syncer is None:
            self._syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="inflight-fsync")
        self._syncing.append(self._syncer.submit(fn, *args))

    def _wait_synced(self) -> None:
        syncing, self._syncing = self._syncing, []
        errors = []
        for future in syncing:
            try:
                future.result()
            except OSError as exc:
                errors.append(exc)
        if errors:
            raise TransportError(f"fsync of a bucket file failed: {errors[0]}")

    def commit(self, version: int) -> None:
        assert self._tmp is not None, "begin() first"
        self._wait_synced()
        manifest = Manifest(version, len(self._files), tuple(self._files), self._checksums, time.time(), self._kv_scales,
                            self._attempt)
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
        # Removing old versions (unlinking large files) is off the version's critical path.
        self._background(self._prune, version)
        log.info("filesystem.published", version=version, buckets=len(self._files), path=str(final))

    def _prune(self, newest: int) -> None:
        versions = published_versions(self.root)
        for old in versions[:-self.keep_last]:
            shutil.rmtree(version_dir(self.root, old), ignore_errors=True)

    def close(self) -> None:
        try:
            self._wait_synced()
        except TransportError:
            pass
        if self._syncer is not None:
            self._syncer.shutdown(wait=True)
            self._syncer = None
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


def _write_all(fd: int, chunks: list) -> None:
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while len(view):
            n = os.write(fd, view)
            view = view[n:]


def _fsync_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class FilesystemReceiver:
    """Reads bucket k as soon as it appears (bounded wait) while bucket k-1 replays."""

    def __init__(self, root: str | os.PathLike, *, arena_bytes: int, timeout_s: float = 60.0,
                 poll_s: float = 0.002):
        self.root = Path(root)
        self.timeout_s = timeout_s
        self.poll_s = poll_s
        # Room for the bucket's payload plus its safetensors header.
        self._arenas = [torch.empty(max(arena_bytes, 1) + (256 << 10), dtype=torch.uint8) for _ in range(2)]

    def _open_bucket(self, version: int, index: int) -> tuple[int, str]:
        """Waits (bounded: `timeout_s` without the file appearing) for bucket `index` of this
        attempt at `version`, in the directory being written or the published one."""
        name = bucket_name(index)
        candidates = (partial_dir(self.root, version) / name, version_dir(self.root, version) / name)
        deadline = time.monotonic() + self.timeout_s
        delay = self.poll_s
        while True:
            for path in candidates:
                try:
                    return os.open(path, os.O_RDONLY), name
                except FileNotFoundError:
                    continue
            if time.monotonic() > deadline:
                raise TransportTimeoutError(f"waiting for bucket {index} of version {version} under {self.root}",
                                            self.timeout_s)
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def receive(self, version: int, staging: StagingArea, *, committed: bool = False) -> None:
        """Receives `version` (attempt `staging.attempt`) into `staging`, bucket by bucket as the
        files appear. `committed=True`: returns only once the version is committed (its
        `COMPLETE` marker written; bounded wait) and the committed files are the ones read
        (same attempt, same checksums); otherwise raises, so a version whose commit never
        happened, or was replaced by another attempt, is never reported staged."""
        pipe = ReplayPipeline(staging, arenas=2, timeout_s=self.timeout_s)
        read: dict[int, FileMeta] = {}
        try:
            k, count = 0, None
            while count is None or k < count:
                slot = pipe.acquire(k)
                header, payload, meta = self._read(version, k, staging.attempt, slot)
                read[k] = meta
                count = header.count
                pipe.submit(slot, header, payload)
                k += 1
            pipe.drain()
        finally:
            pipe.close()
        if committed:
            self.check_committed(version, read)

    def wait_complete(self, version: int) -> Path:
        """The published directory of `version` once its `COMPLETE` marker exists (bounded wait)."""
        final = version_dir(self.root, version)
        deadline = time.monotonic() + self.timeout_s
        delay = self.poll_s
        while not (final / COMPLETE).exists():
            if time.monotonic() > deadline:
                raise TransportTimeoutError(f"waiting for version {version} to be committed ({final / COMPLETE})",
                                            self.timeout_s)
            time.sleep(delay)
            delay = min(delay * 2, 0.05)
        return final

    def committed_metas(self, version: int) -> dict[int, FileMeta]:
        """The bucket headers of the committed files of `version` (after waiting for COMPLETE)."""
        final = self.wait_complete(version)
        try:
            manifest = msgspec.json.decode((final / MANIFEST).read_bytes(), type=Manifest)
            metas = {i: read_bucket_meta(final / bucket_name(i)) for i in range(manifest.bucket_count)}
        except (OSError, msgspec.DecodeError) as exc:
            raise TransportError(f"version {version}: unreadable committed files under {final}: {exc}") from exc
        return metas

    def committed_attempt(self, version: int) -> int:
        """Which attempt at `version` was committed: waits (bounded) for its COMPLETE marker and
        reads the attempt from the committed bucket files."""
        metas = self.committed_metas(version)
        attempts = {m.attempt for m in metas.values()}
        if len(attempts) != 1:
            raise TransportError(f"version {version}: the committed files name attempts {sorted(attempts)}")
        return attempts.pop()

    def check_committed(self, version: int, read: dict[int, FileMeta]) -> None:
        """Waits (bounded) for `version` to be committed and checks that the committed files are
        the ones read: same buckets, same attempt, same checksums."""
        committed = self.committed_metas(version)
        if sorted(committed) != sorted(read):
            raise TransportError(f"version {version}: {len(committed)} buckets were committed, "
                                 f"{len(read)} were read")
        for index, meta in read.items():
            other = committed[index]
            if (other.attempt, other.crc, other.count) != (meta.attempt, meta.crc, meta.count):
                raise TransportError(f"version {version}: bucket {index} read from attempt {meta.attempt} is not "
                                     f"the committed one (attempt {other.attempt})")

    def _read(self, version: int, index: int, attempt: int, slot: int) -> tuple[BucketHeader, memoryview, FileMeta]:
        """Reads bucket `index` into arena `slot` (free: its last replay finished). A short file
        yields a short payload, which staging reports as a truncated bucket naming the first
        tensor cut off."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            fd, name = self._open_bucket(version, index)
            try:
                size = os.fstat(fd).st_size
                if size > self._arenas[slot].numel():  # an unusually large header
                    self._arenas[slot] = torch.empty(size, dtype=torch.uint8)
                view = memoryview(self._arenas[slot].numpy())
                got = 0
                while got < size:
                    n = os.readv(fd, [view[got:size]])
                    if not n:
                        break
                    got += n
            finally:
                os.close(fd)
            meta, tensors = parse_bucket_file(view[:got])
            if meta.version == version and meta.attempt == attempt:
                break
            # A file of another attempt (the trainer is replacing it): wait for ours.
            if time.monotonic() > deadline:
                raise TransportTimeoutError(f"waiting for bucket {index} of version {version}, attempt {attempt}",
                                            self.timeout_s)
            time.sleep(self.poll_s)
        if meta.index != index:
            first = tensors[0].name if tensors else name
            raise MissingTensorError(first, f"{name} holds bucket {meta.index}, expected {index}")
        return BucketHeader(meta.version, meta.index, meta.count, got, tensors, meta.checksums, meta.kv_scales,
                            meta.attempt), view[:got], meta

    def close(self) -> None:
        pass
