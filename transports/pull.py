"""Published versions pulled over HTTP: the filesystem transport for engines on other hosts.

The trainer publishes each version with the filesystem transport into the run directory, which
exists on the orchestrator's host only. An engine on another host cannot read that path, so
its worker *mirrors* a committed version into a scratch directory of its own host before it
stages it, from the orchestrator's HTTP server:

    GET {url}/weights/v00000012/manifest.json     Authorization: Bearer <the run's weights token>
    GET {url}/weights/v00000012/bucket-00000.safetensors
    GET {url}/weights/v00000012/COMPLETE

The server answers only for committed versions (their `COMPLETE` marker exists) and only the
names a version directory holds (`serve_path`); everything else is 404, a missing or wrong
token 401. The mirror is written into a temporary directory, each file checked against the
size the manifest gives, `COMPLETE` last, then renamed into place: the staging code then reads
it exactly as it reads a local filesystem transport (`FilesystemReceiver`, committed files only,
checksums verified while staging). So a version's bytes cross the network once per engine host,
and a version that a restarted or rejoining engine needs is pulled the same way.

Light on purpose (it runs inside vLLM workers): the standard library's `http.client`.
"""

from __future__ import annotations

import hmac
import http.client
import os
import re
import shutil
import time
import urllib.parse
from pathlib import Path

import msgspec

from transports.errors import TransportError, TransportTimeoutError
from transports.filesystem import COMPLETE, MANIFEST, Manifest, version_dir

WEIGHTS_PREFIX = "/weights"
CHUNK = 1 << 20
KEEP_MIRRORED = 2  # the live version and the one being staged
_VERSION_DIR = re.compile(r"^v\d{8}$")
_FILE = re.compile(r"^(bucket-\d{5}\.safetensors|manifest\.json|COMPLETE)$")


def serve_path(root: Path, version_dir_name: str, name: str) -> Path | None:
    """The file a GET may read, or None (404): only the names a committed version holds, never
    a path outside `root`, never a version still being written."""
    if not _VERSION_DIR.match(version_dir_name) or not _FILE.match(name):
        return None
    directory = Path(root) / version_dir_name
    if not (directory / COMPLETE).is_file():
        return None
    path = directory / name
    return path if path.is_file() else None


def authorized(header: str | None, token: str) -> bool:
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip(), token)


def mirror_version(url: str, token: str, version: int, root: str | os.PathLike, timeout_s: float) -> Path:
    """Mirror committed `version` from the weight server at `url` into `root` (a directory of
    this host) and return its directory; waits (bounded by `timeout_s`) for the version to be
    committed. Older mirrors beyond the newest `KEEP_MIRRORED` are removed."""
    root = Path(root)
    target = version_dir(root, version)
    if (target / COMPLETE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + timeout_s
    partial = root / f".pull-{target.name}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    client = _Client(url, token, deadline, timeout_s)
    try:
        manifest_bytes = client.get_waiting(f"{target.name}/{MANIFEST}")
        try:
            manifest = msgspec.json.decode(manifest_bytes, type=Manifest)
        except msgspec.DecodeError as exc:
            raise TransportError(f"pull of version {version} from {url}: {MANIFEST} is not a manifest: {exc}") from None
        if manifest.version != version:
            raise TransportError(f"pull of version {version} from {url}: the manifest names version {manifest.version}")
        for bucket in manifest.buckets:
            got = client.download(f"{target.name}/{bucket.file}", partial / bucket.file)
            if got != bucket.nbytes:
                raise TransportError(f"pull of version {version} from {url}: {bucket.file} has {got} bytes, "
                                     f"the manifest says {bucket.nbytes}")
        (partial / MANIFEST).write_bytes(manifest_bytes)
        (partial / COMPLETE).write_bytes(client.get(f"{target.name}/{COMPLETE}"))
        shutil.rmtree(target, ignore_errors=True)
        partial.rename(target)
    finally:
        client.close()
        shutil.rmtree(partial, ignore_errors=True)
    _prune(root, keep=KEEP_MIRRORED)
    return target


def _prune(root: Path, keep: int) -> None:
    versions = sorted(p for p in root.iterdir() if p.is_dir() and _VERSION_DIR.match(p.name))
    for old in versions[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


class _Client:
    """One kept-alive connection to the weight server; every operation within the deadline."""

    def __init__(self, url: str, token: str, deadline: float, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise TransportError(f"weights url must be http://HOST:PORT, got {url!r}")
        self.url, self.host, self.port = url, parts.hostname, parts.port or 80
        self.base = parts.path.rstrip("/") + WEIGHTS_PREFIX
        self.headers = {"Authorization": f"Bearer {token}"}
        self.deadline, self.timeout_s = deadline, timeout_s
        self.conn: http.client.HTTPConnection | None = None

    def _remaining(self, what: str) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransportTimeoutError(f"pull of {what} from {self.url}", self.timeout_s)
        return left

    def _open(self, name: str) -> http.client.HTTPResponse:
        timeout = self._remaining(name)
        if self.conn is None:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        self.conn.timeout = timeout
        try:
            self.conn.request("GET", f"{self.base}/{name}", headers=self.headers)
            return self.conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise TransportError(f"pull of {name} from {self.url}: {type(exc).__name__}: {exc}") from None

    def _checked(self, name: str, response: http.client.HTTPResponse) -> http.client.HTTPResponse:
        if response.status == 200:
            return response
        body = response.read()[:200]
        raise TransportError(f"pull of {name} from {self.url}: HTTP {response.status} {body!r}")

    def get(self, name: str) -> bytes:
        response = self._checked(name, self._open(name))
        try:
            return response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise TransportError(f"pull of {name} from {self.url}: {type(exc).__name__}: {exc}") from None

    def get_waiting(self, name: str, poll_s: float = 0.2) -> bytes:
        """GET, waiting while the server says 404 (the version is not committed yet)."""
        while True:
            response = self._open(name)
            if response.status != 404:
                self._checked(name, response)
                return response.read()
            response.read()
            time.sleep(min(poll_s, self._remaining(name)))

    def download(self, name: str, path: Path) -> int:
        response = self._checked(name, self._open(name))
        written = 0
        try:
            with open(path, "wb") as out:
                while chunk := response.read(CHUNK):
                    out.write(chunk)
                    written += len(chunk)
                    self._remaining(name)
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise TransportError(f"pull of {name} from {self.url}: {type(exc).__name__}: {exc}") from None
        return written

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None
