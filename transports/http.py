"""HTTP transport: buckets streamed to a small HTTP receiver in the engine, for remote engines
without a collective (and colocated SGLang).

The receiver listens on the address given in its init info. The trainer PUTs each bucket to
`/inflight/v1/bucket` with the msgpack header base64'd in `X-Inflight-Header` and the payload as
the body (`Content-Length` exact). The handler reads the body straight into a free arena (two,
reused) and answers once it is queued; the engine's `receive()` replays it while the next
bucket streams in. A body shorter than announced is staged as-is and reported as a truncated
bucket naming the first tensor cut off.

Every bucket PUT carries `Authorization: Bearer <token>`: a per-run secret the sender generates
and hands to each receiver in its init info; a request without it (or with another) is answered
401 and its body never read. The receiver listens on the address of its init info (127.0.0.1
unless configured otherwise). Malformed input is answered, never staged, and the receiver keeps
serving: no or a non-numeric / negative `Content-Length` 411 / 400, `Transfer-Encoding`
(chunked) 501, a body over the arena 413; every answer other than 200, and every request that
asked for `Connection: close`, ends its connection with `Connection: close`.

The sender speaks HTTP/1.1 itself over one kept-alive socket per engine: the request head, then
`sendall` straight from the packed arena (no copy into an HTTP library's buffers). Requests are
pipelined one deep: bucket k+1 is written before the answer to bucket k is read, so the socket
never idles for a round trip between buckets (`plan.pack(..., hold=1)` keeps bucket k's arena
intact until its answer came). Every socket operation has the sender's timeout.
"""

from __future__ import annotations

import base64
import hmac
import queue
import re
import secrets
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog
import torch

from transports.errors import TransportError, TransportTimeoutError
from transports.staging import ReplayPipeline, StagingArea
from transports.wire import BucketHeader, decode_header, encode_header

log = structlog.get_logger("transports.http")

BUCKET_PATH = "/inflight/v1/bucket"
HEALTH_PATH = "/inflight/v1/health"
HEADER = "X-Inflight-Header"
SOCKET_BUFFER = 8 << 20  # asked for; the kernel caps it (net.core.[rw]mem_max)
_MAX_HEAD = 64 << 10
_DIGITS = re.compile(r"[0-9]{1,18}")


def new_token() -> str:
    """A per-run secret for the bucket receivers (256 bits, URL-safe)."""
    return secrets.token_urlsafe(32)


def content_length(values: list[str] | None) -> int | None:
    """The body length of a request's `Content-Length` header(s): None when absent; raises
    ValueError for a non-numeric or negative value, or several that disagree."""
    if not values:
        return None
    lengths = {v.strip() for v in values}
    if len(lengths) != 1:
        raise ValueError(f"conflicting Content-Length values {sorted(lengths)}")
    (text,) = lengths
    if not _DIGITS.fullmatch(text):
        raise ValueError(f"Content-Length {text!r} is not a non-negative decimal number")
    return int(text)


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

    def send_request(self, method: str, path: str, headers: dict[str, str], body: memoryview | None) -> None:
        """Writes one request; its answer is read by a later `response()` (answers come in
        request order, so requests may be pipelined)."""
        length = len(body) if body is not None else 0
        head = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}", f"Content-Length: {length}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        if length:
            self.sock.sendall(body)

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

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        host, port = self.endpoints[engine_index]
        return {"host": host, "port": port, "timeout_s": self.timeout_s, "token": self.token}

    def connect(self) -> None:
        """Waits (bounded) until every engine's receiver answers: engines start theirs while
        this runs."""
        deadline = time.monotonic() + self.timeout_s
        for host, port in self.endpoints:
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

    def send(self, header: BucketHeader, payload: memoryview) -> None:
        meta = base64.b64encode(encode_header(header)).decode()
        headers = {HEADER: meta, "Content-Type": "application/octet-stream", "Authorization": f"Bearer {self.token}"}
        for host, port in self.endpoints:
            self._io(host, port, "PUT", BUCKET_PATH,
                     lambda conn: conn.send_request("PUT", BUCKET_PATH, headers, payload))
        self._unanswered.append((header.index, f"bucket {header.index}"))
        while len(self._unanswered) > self.in_flight:
            self._read_answers()

    def _read_answers(self) -> None:
        """Reads every engine's answer to the oldest unanswered bucket."""
        self._unanswered.pop(0)
        for host, port in self.endpoints:
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
        while self._unanswered:
            self._read_answers()

    def close(self) -> None:
        self._unanswered = []
        for key in list(self._connections):
            self._drop(key)


class _Short(Exception):
    """The request body ended (or stalled) `got` bytes into the current read."""

    def __init__(self, got: int):
        self.got = got


class HttpReceiver:
    """`token`: the sender's per-run secret (`HttpSender.token`, in the init info); every bucket
    PUT must carry it. None: a fresh random one (nobody can send until told `receiver.token`)."""

    def __init__(self, *, host: str, port: int, arena_bytes: int, timeout_s: float = 60.0, token: str | None = None):
        self.timeout_s = timeout_s
        self.token = token or new_token()
        self._arenas = [torch.empty(max(arena_bytes, 1), dtype=torch.uint8) for _ in range(2)]
        self._free = [threading.Semaphore(1), threading.Semaphore(1)]
        self._next_slot = 0
        self._slot_lock = threading.Lock()
        self._arrived: queue.Queue = queue.Queue()
        self._staging: StagingArea | None = None  # the version being received, for `landing`
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="inflight-http", daemon=True)
        self._thread.start()
        log.info("http.listening", host=host, port=self.port)

    def _handler(self):
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:  # quiet: structlog is the log
                pass

            def setup(self) -> None:
                self.request.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
                # The answer goes out as head + body: without NODELAY, Nagle holds the body back
                # until the trainer's delayed ACK (~40 ms per bucket).
                self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                super().setup()

            def _reply(self, code: int, text: str, headers: dict[str, str] | None = None) -> None:
                if code != 200:
                    self.close_connection = True  # the body may be unread: end this connection
                body = text.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                if self.close_connection:
                    self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def _has_body(self) -> bool:
                return bool(self.headers.get_all("Transfer-Encoding")) or any(
                    v.strip() not in ("", "0") for v in self.headers.get_all("Content-Length") or ())

            def do_GET(self) -> None:
                if self._has_body():
                    self.close_connection = True  # an unread body would be parsed as the next request
                if self.path != HEALTH_PATH:
                    return self._reply(404, "unknown path")
                self._reply(200, "ok")

            def do_PUT(self) -> None:
                try:
                    self._put()
                except Exception as exc:  # never a dead handler thread and an unanswered request
                    log.warning("http.put_failed", error=f"{type(exc).__name__}: {exc}")
                    self.close_connection = True
                    try:
                        self._reply(500, f"{type(exc).__name__}: {exc}")
                    except OSError:
                        pass

            def _authorized(self) -> bool:
                given = self.headers.get("Authorization", "")
                return hmac.compare_digest(given.encode("latin-1", "replace"),
                                           f"Bearer {receiver.token}".encode("latin-1"))

            def _put(self) -> None:
                if self.path != BUCKET_PATH:
                    return self._reply(404, "unknown path")
                if not self._authorized():
                    return self._reply(401, "a bucket needs the run's token (Authorization: Bearer ...)",
                                       {"WWW-Authenticate": "Bearer"})
                if self.headers.get_all("Transfer-Encoding"):
                    return self._reply(501, "Transfer-Encoding is not supported: send Content-Length")
                try:
                    length = content_length(self.headers.get_all("Content-Length"))
                except ValueError as exc:
                    return self._reply(400, f"bad bucket request: {exc}")
                if length is None:
                    return self._reply(411, "a bucket needs Content-Length")
                capacity = receiver._arenas[0].numel()
                if length > capacity:
                    return self._reply(413, f"{length} bytes exceed the arena ({capacity})")
                try:
                    header = decode_header(base64.b64decode(self.headers[HEADER] or "", validate=True))
                except Exception as exc:  # a malformed request, not a transfer
                    return self._reply(400, f"bad bucket request: {exc}")
                slot = receiver._claim_slot()
                if slot is None:
                    return self._reply(503, "no free arena: the engine is not receiving")
                try:
                    arena = memoryview(receiver._arenas[slot].numpy())
                    # Tensors the staging area can take as they are are read straight into their
                    # staging tensors (no copy out of the arena later); the rest, and the padding
                    # between tensors, into the arena at their offsets.
                    staging = receiver._staging
                    landed = staging.landing(header) if staging is not None else {}
                    spans, kept = [], {}
                    for m in sorted(header.tensors, key=lambda m: m.offset):
                        flat = landed.get(m.name)
                        if (flat is not None and m.name not in kept and m.offset >= (spans[-1][1] if spans else 0)
                                and m.offset + m.nbytes <= length):
                            spans.append((m.offset, m.offset + m.nbytes, flat))
                            kept[m.name] = flat
                    landed = kept  # anything else (overlapping spans of a malformed header) via the arena
                    got = 0
                    self.connection.settimeout(receiver.timeout_s)
                    try:
                        for start, end, flat in [*spans, (length, length, None)]:
                            self._read_into(arena[got:start])
                            got = start
                            if flat is not None:
                                self._read_into(memoryview(flat.numpy()))
                                got = end
                    except _Short as short:
                        got += short.got
                    except OSError:
                        pass  # a stalled or vanished sender: stage what arrived, staging names the cut
                except BaseException:
                    receiver._free[slot].release()  # never queued: the arena is free again
                    raise
                receiver._arrived.put((slot, header, arena[:got], landed))
                self._reply(200, "queued")

            def _read_into(self, view: memoryview) -> None:
                """Fills `view` from the body; raises `_Short` (bytes read) if the body ends first."""
                filled = 0
                while filled < len(view):
                    try:
                        n = self.rfile.readinto(view[filled:])
                    except OSError:
                        raise _Short(filled) from None
                    if not n:
                        raise _Short(filled)
                    filled += n

        return Handler

    def _claim_slot(self) -> int | None:
        with self._slot_lock:
            slot = self._next_slot
            self._next_slot = 1 - slot
        if not self._free[slot].acquire(timeout=self.timeout_s):
            return None
        return slot

    def receive(self, version: int, staging: StagingArea) -> None:
        """A rejected bucket does not end the loop: the rest of the version is still taken in
        (and dropped) so the trainer's requests complete, then the error is raised."""
        pipe = ReplayPipeline(staging, arenas=1, timeout_s=self.timeout_s)
        error: TransportError | None = None
        self._staging = staging
        try:
            k, count = 0, None
            while count is None or k < count:
                try:
                    slot, header, payload, landed = self._arrived.get(timeout=self.timeout_s)
                except queue.Empty as exc:
                    raise TransportTimeoutError(f"waiting for bucket {k} of version {version}", self.timeout_s) from exc
                if not staging.is_current(header):
                    self._free[slot].release()  # left over from an abandoned attempt
                    continue
                count = header.count
                if error is None:
                    try:
                        pipe.acquire(0)  # replay one bucket at a time, in arrival order
                    except TransportError as exc:
                        error = exc
                if error is None:
                    pipe.submit(0, header, payload, after=self._free[slot].release, landed=landed)
                else:
                    self._free[slot].release()
                k += 1
            if error is None:
                pipe.drain()
        except TransportError as exc:
            error = error or exc
        finally:
            self._staging = None
            pipe.close()
        if error is not None:
            self._drop_queued()
            raise error

    def _drop_queued(self) -> None:
        """After a failed version, free arenas still holding its buckets."""
        while True:
            try:
                slot, _, _, _ = self._arrived.get_nowait()
            except queue.Empty:
                return
            self._free[slot].release()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
