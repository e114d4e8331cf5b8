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

The sender (`transports.http_sender`) speaks HTTP/1.1 itself over one kept-alive socket per engine: the request head and
the body in vectored `sendmsg` calls, straight from the trainer's own tensors where a tensor is
contiguous and already in the wire dtype (`DirectArenas` / `BucketPayload`: no pack copy), from
the arena for the rest. The packing thread checksums bucket k+1 (and packs what needs a copy)
while bucket k is on the wire. Requests are pipelined one deep: bucket k+1 is written before the
answer to bucket k is read, so the socket never idles for a round trip between buckets
(`plan.pack(..., hold=1)` keeps bucket k's arena intact until its answer came). Every socket
operation has the sender's timeout.

The receiver checksums each tensor while reading it (1 MiB at a time, from cache) instead of in
a second pass over the landed bytes; when every tensor of a bucket matched, the staging area
is told not to recompute them (it still checks everything else). On any mismatch it does
recompute them and raises `ChecksumError` naming the tensor, exactly as before.
"""

from __future__ import annotations

import base64
import collections
import hmac
import queue
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
import structlog
import torch

from transports.errors import TransportError, TransportTimeoutError
from transports.http_common import (
    _CRC_CHUNK,
    BUCKET_PATH,
    HEADER,
    HEALTH_PATH,
    SOCKET_BUFFER,
    content_length,
    new_token,
)
from transports.http_sender import HttpSender  # noqa: F401 - re-exported: the sender's end
from transports.staging import ReplayPipeline, StagingArea
from transports.wire import checksum_final, checksum_update, decode_header

log = structlog.get_logger("transports.http")


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
        # Buckets of a later version or attempt that arrived while an earlier one was being
        # received (or after it failed): the next `receive` takes them first, in arrival order.
        self._held: collections.deque = collections.deque()
        self._staging: StagingArea | None = None  # the version being received, for `landing`
        self._conns: set[socket.socket] = set()  # open connections, ended by close()
        self._conn_lock = threading.Lock()
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
                with receiver._conn_lock:
                    receiver._conns.add(self.request)
                super().setup()

            def finish(self) -> None:
                with receiver._conn_lock:
                    receiver._conns.discard(self.request)
                super().finish()

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
                finally:
                    # The body's reads (and the answer) are bounded by the timeout; the wait for the
                    # next request on this kept-alive connection is not: the trainer's next version
                    # may come a whole training step later (a timeout here closed the connection,
                    # and the trainer's next sync_weights failed on it).
                    try:
                        self.connection.settimeout(None)
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
                    # between tensors, into the arena at their offsets. Each tensor's checksum is
                    # computed while it is read, chunk by chunk from cache (see `_read_into`).
                    staging = receiver._staging
                    landing = staging.landing(header) if staging is not None else {}
                    spans, landed = [], {}
                    for m in sorted(header.tensors, key=lambda m: m.offset):
                        if m.offset < (spans[-1][1] if spans else 0) or m.offset + m.nbytes > length:
                            continue  # overlapping or past the body: left to the staging area's checks
                        flat = landing.get(m.name)
                        if flat is not None and m.name not in landed:
                            landed[m.name] = flat
                            target = memoryview(flat.numpy())
                        else:
                            target = arena[m.offset:m.offset + m.nbytes]
                        spans.append((m.offset, m.offset + m.nbytes, target, m))
                    got, sums = 0, {}
                    self.connection.settimeout(receiver.timeout_s)
                    try:
                        for start, end, target, m in spans:
                            self._read_into(arena[got:start])
                            got = start
                            crc = self._read_into(target, header.checksums)
                            got = end
                            sums[m.name] = (checksum_final(crc), m)
                        self._read_into(arena[got:length])
                        got = length
                    except _Short as short:
                        got += short.got
                    except OSError:
                        pass  # a stalled or vanished sender: stage what arrived, staging names the cut
                    if header.checksums and len(sums) == len(header.tensors) and all(
                            crc == m.checksum for crc, m in sums.values()):
                        # Every tensor's bytes were checksummed as they arrived and match: the
                        # staging area checks everything else. On any doubt it recomputes them
                        # itself (and names the tensor that disagrees).
                        header = msgspec.structs.replace(header, checksums=False)
                except BaseException:
                    receiver._free[slot].release()  # never queued: the arena is free again
                    raise
                receiver._arrived.put((slot, header, arena[:got], landed))
                self._reply(200, "queued")

            def _read_into(self, view: memoryview, crc: bool = False) -> int:
                """Fills `view` from the body; raises `_Short` (bytes read) if the body ends
                first. `crc`: returns the running checksum of the bytes (`checksum_update`),
                computed piece by piece right after each piece is read, while it is in cache."""
                filled, value, size = 0, 0, len(view)
                step = _CRC_CHUNK if crc else size
                while filled < size:
                    try:
                        n = self.rfile.readinto(view[filled:min(size, filled + step)])
                    except OSError:
                        raise _Short(filled) from None
                    if not n:
                        raise _Short(filled)
                    if crc:
                        value = checksum_update(view[filled:filled + n], value)
                    filled += n
                return value

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
        (and dropped) so the trainer's requests complete, then the error is raised. A bucket of
        a later version or attempt (`StagingArea.is_newer`: the trainer moved on) ends it at once
        with a `TransportError` and is kept for the next receive."""
        pipe = ReplayPipeline(staging, arenas=1, timeout_s=self.timeout_s)
        error: TransportError | None = None
        self._staging = staging
        try:
            k, count = 0, None
            while count is None or k < count:
                try:
                    item = self._held.popleft() if self._held else self._arrived.get(timeout=self.timeout_s)
                except queue.Empty as exc:
                    raise TransportTimeoutError(f"waiting for bucket {k} of version {version}", self.timeout_s) from exc
                slot, header, payload, landed = item
                if not staging.is_current(header):
                    if staging.is_newer(header):
                        # The trainer moved on (a retry of this version, or the next one): this
                        # version can no longer complete. Keep the bucket for the next receive.
                        self._held.append(item)
                        raise TransportError(
                            f"version {version}: bucket {header.index} of version {header.version} (attempt "
                            f"{header.attempt}) arrived after {k} of {count if count is not None else '?'} buckets "
                            f"of attempt {staging.attempt}: the trainer has moved past it (a retried attempt, or a later "
                            "version)")
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
            self._drop_queued(staging)
            raise error

    def _drop_queued(self, staging: StagingArea) -> None:
        """After a failed version, free arenas still holding its buckets (or older ones); a
        bucket of a later version or attempt, or of this version when no attempt of it had
        started arriving (a receive that timed out just before the trainer began), is kept for
        the next receive."""
        while True:
            try:
                item = self._arrived.get_nowait()
            except queue.Empty:
                return
            header = item[1]
            if staging.is_newer(header) or (header.version == staging.version and staging.attempt is None):
                self._held.append(item)
            else:
                self._free[item[0]].release()

    def close(self) -> None:
        """Stops listening and ends every open connection: a kept-alive trainer connection left
        to its handler would have its next buckets answered "queued" into this closed receiver;
        ended, the trainer's send fails and its next attempt connects to whoever listens now."""
        self._server.shutdown()
        self._server.server_close()
        with self._conn_lock:
            conns, self._conns = list(self._conns), set()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
