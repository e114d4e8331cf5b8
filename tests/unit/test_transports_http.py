"""The HTTP transport's socket settings: both ends send without Nagle's delay. Without
TCP_NODELAY on the engine's socket each answer (head, then body) waits ~40 ms for the
trainer's delayed ACK, a stall per bucket. The receiver's input handling: malformed requests
(length, framing) and requests without the run's token get a 4xx, and it keeps serving."""

from __future__ import annotations

import base64
import socket
import threading

import pytest
import torch

from tests.helpers import raw_http
from transports.http import BUCKET_PATH, HEADER, HttpReceiver, HttpSender
from transports.refit.plan import RefitPlan
from transports.staging import StagingArea
from transports.wire import encode_header


def test_both_ends_of_a_bucket_connection_disable_nagle():
    receiver = HttpReceiver(host="127.0.0.1", port=0, arena_bytes=1024, timeout_s=5)
    handler = receiver._server.RequestHandlerClass
    engine_side: list[int] = []
    setup = handler.setup

    def recording_setup(self) -> None:
        setup(self)
        engine_side.append(self.request.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    handler.setup = recording_setup
    sender = HttpSender(endpoints=[("127.0.0.1", receiver.port)], timeout_s=5)
    try:
        sender.connect()
        assert engine_side and all(engine_side)
        (conn,) = sender._connections.values()
        assert conn.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        sender.close()
        receiver.close()

# -- malformed input and the per-run token (issue 11: item 11, security) ----------------------



def one_bucket_plan():
    state = {"a": torch.arange(16, dtype=torch.float32).view(4, 4), "b": torch.ones(8)}
    plan = RefitPlan.build({k: (tuple(v.shape), v.dtype) for k, v in state.items()}, wire_dtype=None)
    assert plan.bucket_count == 1
    return plan, state


def bucket_request(header, payload: bytes, *, token: str | None, extra: str = "", length: str | None = None) -> bytes:
    meta = base64.b64encode(encode_header(header)).decode()
    lines = [f"PUT {BUCKET_PATH} HTTP/1.1", "Host: 127.0.0.1", f"{HEADER}: {meta}"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    if length is not None:
        lines.append(f"Content-Length: {length}")
    lines += [line for line in extra.split("\r\n") if line]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + payload


def transfer_works(receiver, plan, state, version: int) -> None:
    """A whole version through a real sender holding the run's token."""
    sender = HttpSender(endpoints=[("127.0.0.1", receiver.port)], timeout_s=5, token=receiver.token)
    staging = StagingArea(plan)
    staging.begin(version, 1)
    errors = []
    thread = threading.Thread(target=lambda: _catch(errors, receiver.receive, version, staging))
    thread.start()
    try:
        sender.connect()
        sender.begin(version, plan.bucket_count)
        for header, payload in plan.pack(state, version=version, attempt=1, prefetch=False):
            sender.send(header, payload)
        sender.commit(version)
    finally:
        sender.close()
    thread.join(10)
    assert not errors, errors
    got = staging.finish()
    assert all(torch.equal(got[k], state[k]) for k in state)


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as exc:
        errors.append(exc)


@pytest.fixture
def receiver():
    plan, _ = one_bucket_plan()
    r = HttpReceiver(host="127.0.0.1", port=0, arena_bytes=plan.arena_bytes, timeout_s=2, token="run-secret")
    yield r
    r.close()


@pytest.mark.parametrize("length,extra,status", [
    ("-5", "", 400),                                  # negative
    ("12abc", "", 400),                               # not a number
    ("0x10", "", 400),
    ("+16", "", 400),
    (None, "", 411),                                  # no length at all
    (None, "Transfer-Encoding: chunked", 501),        # chunked
    ("16", "Transfer-Encoding: chunked", 501),        # both: never guess which one frames the body
    ("16", "Content-Length: 17", 400),                # two lengths that disagree
    ("99999999999", "", 413),                         # more than the arena
])
def test_malformed_bucket_requests_get_a_4xx_and_the_receiver_keeps_serving(receiver, length, extra, status):
    plan, state = one_bucket_plan()
    header, payload = next(iter(plan.pack(state, version=1, attempt=1, prefetch=False)))
    body = b"5\r\nhello\r\n0\r\n\r\n" if "chunked" in extra else bytes(payload)[:16]
    got, answer = raw_http("127.0.0.1", receiver.port, bucket_request(header, body, token="run-secret", extra=extra,
                                                                      length=length))
    assert got == status, answer
    assert b"connection: close" in answer.lower()
    transfer_works(receiver, plan, state, version=2)


@pytest.mark.parametrize("token", [None, "wrong", ""])
def test_a_bucket_without_the_run_token_is_refused_with_401(receiver, token):
    plan, state = one_bucket_plan()
    header, payload = next(iter(plan.pack(state, version=1, attempt=1, prefetch=False)))
    got, answer = raw_http("127.0.0.1", receiver.port, bucket_request(header, bytes(payload), token=token,
                                                                      length=str(len(payload))))
    assert got == 401, answer
    assert b"www-authenticate: bearer" in answer.lower()
    assert receiver._arrived.empty()  # nothing of it was queued for staging
    transfer_works(receiver, plan, state, version=2)


def test_connection_close_is_honoured_and_answered(receiver):
    plan, state = one_bucket_plan()
    header, payload = next(iter(plan.pack(state, version=1, attempt=1, prefetch=False)))
    request = bucket_request(header, bytes(payload), token="run-secret", length=str(len(payload)),
                             extra="Connection: close")
    with socket.create_connection(("127.0.0.1", receiver.port), timeout=5) as sock:
        sock.sendall(request)  # the write side stays open: only the server may end the connection
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer.lower()
    staging = StagingArea(plan)
    staging.begin(1, 1)
    receiver.receive(1, staging)
    got = staging.finish()
    assert all(torch.equal(got[k], state[k]) for k in state)
    transfer_works(receiver, plan, state, version=2)


def test_the_sender_hands_its_token_to_every_receiver():
    sender = HttpSender(endpoints=[("127.0.0.1", 1), ("127.0.0.1", 2)], timeout_s=1)
    infos = [sender.engine_init_info(i) for i in range(2)]
    assert infos[0]["token"] == infos[1]["token"] == sender.token and len(sender.token) >= 32
    assert HttpSender(endpoints=[], timeout_s=1).token != sender.token  # per run
