"""The trainer's end of the HTTP transport (see `transports.http` for the protocol): HTTP/1.1
spoken over one kept-alive socket per engine, the request head and the body in vectored
`sendmsg` calls, straight from the trainer's own tensors where a tensor is contiguous and
already in the wire dtype (`DirectArenas` / `BucketPayload`), pipelined one deep. Every socket
operation has the sender's timeout."""

from __future__ import annotations

import base64
import socket
import time
from typing import Any

from transports.errors import TransportError, TransportTimeoutError
from transports.http_common import (
    _IOV_MAX,
    _MAX_HEAD,
    BUCKET_PATH,
    HEADER,
    HEALTH_PATH,
    SOCKET_BUFFER,
    new_token,
)
from transports.refit.plan import BucketPayload, DirectArenas
from transports.wire import BucketHeader, encode_header


class _Connection:
    """One HTTP/1.1 keep-alive connection; every wait bounded by `timeout_s`."""

    def __init__(self, host: str, port: int, timeout_s: float):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        self._buffer = bytearray()

    def request(self, method: str, path: str, headers: dict[str, str], body: memoryview | None) -> tuple[int, bytes]:
        self.send_request(method, path, headers, body)
        return self.response()

    def send_request(self, method: str, path: str, headers: dict[str, str],
                     body: memoryview | list[memoryview] | None) -> None:
        """Writes one request; its answer is read by a later `response()` (answers come in
        request order, so requests may be pipelined). `body`: one buffer, or several written
        in order (the trainer's own tensors: no copy into a bucket first)."""
        parts = [] if body is None else body if isinstance(body, list) else [body]
        length = sum(len(p) for p in parts)
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {length}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self._send_all([memoryview(("\r\n".join(head) + "\r\n\r\n").encode("latin-1")), *parts])

    def _send_all(self, buffers: list[memoryview]) -> None:
        """Vectored `sendall`: the head and every buffer in as few `sendmsg` calls as the
        kernel takes (each bounded by the socket's timeout)."""
        pending = [b for b in buffers if len(b)]
        first = 0
        while first < len(pending):
            sent = self.sock.sendmsg(pending[first:first + _IOV_MAX])
            while sent:
                size = len(pending[first])
                if sent >= size:
                    sent -= size
                    first += 1
                else:
                    pending[first] = pending[first][sent:]
                    sent = 0

    def response(self) -> tuple[int, bytes]:
        while (end := self._buffer.find(b"\r\n\r\n")) < 0:
            if len(self._buffer) > _MAX_HEAD:
                raise TransportError(f"http://{self.host}:{self.port}: answer head over {_MAX_HEAD} bytes")
            self._fill()
        lines = bytes(self._buffer[:end]).decode("latin-1").split("\r\n")
        del self._buffer[:end + 4]
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError) as exc:
            raise TransportError(f"http://{self.host}:{self.port}: bad status line {lines[0]!r}") from exc
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(":")
            if name.strip().lower() == "content-length":
                length = int(value.strip())
        while len(self._buffer) < length:
            self._fill()
        body = bytes(self._buffer[:length])
        del self._buffer[:length]
        return status, body

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the engine closed the connection")
        self._buffer += data

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class HttpSender:
    #: `send(k)` returns once bucket k is written, before the engine's answer to it: the answer
    #: is read after bucket k+1 was written (HTTP/1.1 pipelining), so the wire never idles for
    #: a round trip between buckets. `commit()` reads the last answers.
    in_flight = 1

    def __init__(self, *, endpoints: list[tuple[str, int]], timeout_s: float = 60.0, token: str | None = None):
        self.endpoints = endpoints
        self.timeout_s = timeout_s
        self.token = token or new_token()  # handed to every receiver in its init info
        self._connections: dict[tuple[str, int], _Connection] = {}
        self._unanswered: list[tuple[int, str]] = []  # (bucket index, what) whose answers are unread
        self._arenas = DirectArenas()  # filled by the refit plan on first use, kept across versions
        self._excluded: set[int] = set()  # engines left out of every version (see `exclude`)
        self._included: set[int] = set()  # taken back: waited for at the next `begin` (see `include`)

    def arenas(self) -> DirectArenas:
        """Where the refit plan packs: only tensors that need a copy (a view that is not
        contiguous, another wire dtype) land here; the rest are written from the trainer's own
        memory (`BucketPayload`)."""
        return self._arenas

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        host, port = self.endpoints[engine_index]
        return {"host": host, "port": port, "timeout_s": self.timeout_s, "token": self.token}

    def exclude(self, engine_index: int) -> None:
        """Leave engine `engine_index` out of every version from the next one on (a fenced
        engine: nothing is sent to it, no answer awaited). Call between versions."""
        self._check_index(engine_index)
        if self._unanswered:
            raise TransportError("exclude() during a version: call it between versions")
        self._excluded.add(engine_index)
        self._drop(self.endpoints[engine_index])

    def include(self, engine_index: int) -> None:
        """Send to engine `engine_index` again from the next version on (over a new connection:
        a restarted engine's receiver listens at the same address). Call between versions. The
        next `begin` waits (bounded) until its receiver answers: a restarted engine builds its
        receiver on a thread, and a bucket sent before it listens would fail the version."""
        self._check_index(engine_index)
        if self._unanswered:
            raise TransportError("include() during a version: call it between versions")
        self._excluded.discard(engine_index)
        self._included.add(engine_index)

    def _check_index(self, engine_index: int) -> None:
        if not 0 <= engine_index < len(self.endpoints):
            raise TransportError(f"engine index {engine_index} is outside 0..{len(self.endpoints) - 1}")

    def _targets(self) -> list[tuple[str, int]]:
        return [e for i, e in enumerate(self.endpoints) if i not in self._excluded]

    def connect(self) -> None:
        """Waits (bounded) until every engine's receiver answers: engines start theirs while
        this runs."""
        self._await_listening(self._targets())

    def _await_listening(self, endpoints: list[tuple[str, int]]) -> None:
        deadline = time.monotonic() + self.timeout_s
        for host, port in endpoints:
            while True:
                try:
                    self._request(host, port, "GET", HEALTH_PATH, None, {})
                    break
                except TransportError:
                    if time.monotonic() > deadline:
                        raise TransportTimeoutError(f"engine receiver at {host}:{port} to listen", self.timeout_s)
                    time.sleep(0.05)

    def begin(self, version: int, bucket_count: int) -> None:
        if self._unanswered:  # a failed version left answers unread: start on fresh connections
            self._unanswered = []
            for key in list(self._connections):
                self._drop(key)
        if self._included:
            included, self._included = sorted(self._included - self._excluded), set()
            self._await_listening([self.endpoints[i] for i in included])

    def send(self, header: BucketHeader, payload: memoryview | BucketPayload) -> None:
        meta = base64.b64encode(encode_header(header)).decode()
        headers = {HEADER: meta, "Content-Type": "application/octet-stream", "Authorization": f"Bearer {self.token}"}
        body = _body(payload)
        try:
            for host, port in self._targets():
                self._io(host, port, "PUT", BUCKET_PATH,
                         lambda conn: conn.send_request("PUT", BUCKET_PATH, headers, body))
            self._unanswered.append((header.index, f"bucket {header.index}"))
            while len(self._unanswered) > self.in_flight:
                self._read_answers()
        except BaseException:
            self._reset()
            raise

    def _read_answers(self) -> None:
        """Reads every engine's answer to the oldest unanswered bucket."""
        self._unanswered.pop(0)
        for host, port in self._targets():
            self._check(host, port, "PUT", BUCKET_PATH, self._io(host, port, "PUT", BUCKET_PATH,
                                                                 lambda conn: conn.response()))

    def _request(self, host: str, port: int, method: str, path: str, body: memoryview | None,
                 headers: dict[str, str]) -> None:
        status_text = self._io(host, port, method, path, lambda conn: conn.request(method, path, headers, body))
        self._check(host, port, method, path, status_text)

    def _io(self, host: str, port: int, method: str, path: str, call):
        """Runs `call(connection)` with every failure a `TransportError` (timeouts typed)."""
        url = f"http://{host}:{port}{path}"
        key = (host, port)
        try:
            conn = self._connections.get(key)
            if conn is None:
                conn = self._connections[key] = _Connection(host, port, self.timeout_s)
            return call(conn)
        except TimeoutError as exc:  # socket.timeout
            self._drop(key)
            raise TransportTimeoutError(f"{method} {url}", self.timeout_s) from exc
        except OSError as exc:
            self._drop(key)
            raise TransportError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        except TransportError:
            self._drop(key)
            raise

    def _check(self, host: str, port: int, method: str, path: str, status_text) -> None:
        status, text = status_text
        if status != 200:
            self._drop((host, port))  # the engine may not have read the body: start afresh
            raise TransportError(f"{method} http://{host}:{port}{path}: {status} {text.decode(errors='replace')}")

    def _drop(self, key: tuple[str, int]) -> None:
        conn = self._connections.pop(key, None)
        if conn is not None:
            conn.close()

    def commit(self, version: int) -> None:
        try:
            while self._unanswered:
                self._read_answers()
        except BaseException:
            self._reset()
            raise

    def _reset(self) -> None:
        """After a failed send: requests may have been written whose answers nobody will read
        (to the engines before the one that failed, or the other engines' answers to the bucket
        whose answer failed). A kept connection would hand them out as the answers to the next
        version's buckets, one late, leaving that version's last answer unread: every connection
        starts afresh."""
        self._unanswered = []
        for key in list(self._connections):
            self._drop(key)

    def close(self) -> None:
        self._reset()


def _body(payload: memoryview | BucketPayload) -> list[memoryview]:
    """The buffers of one bucket's body: a packed payload as it is, a `BucketPayload` as the
    trainer's own tensors with the arena spans between them (written by one vectored call)."""
    if isinstance(payload, BucketPayload):
        return [memoryview(t.numpy()) for t in payload.segments() if t.numel()]
    return [payload]
