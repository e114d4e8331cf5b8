"""The HTTP transport's socket settings: both ends send without Nagle's delay. Without
TCP_NODELAY on the engine's socket each answer (head, then body) waits ~40 ms for the
trainer's delayed ACK, a stall per bucket."""

from __future__ import annotations

import socket

from transports.http import HttpReceiver, HttpSender


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
