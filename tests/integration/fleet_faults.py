"""Fault injection for the trainer process of `test_activation_transports.py`: wraps a real
sender for one `sync_weights()` (named in the trainer's config as
`tests.integration.fleet_faults:wrap`)."""

from __future__ import annotations

import base64
import socket
import time

from transports.errors import TransportError

#: How long a hung trainer stalls: longer than the receivers' timeout in the tests.
HANG_S = 12.0


class FaultySender:
    """`corrupt`: flips one byte of bucket 0 after its checksum was computed. `hang`: stalls
    before bucket 1 (longer than the receivers wait), then gives the version up. `drop` (http):
    bucket 1 is cut off half-way and its connection closed, then the version is given up."""

    def __init__(self, inner, fault: str):
        self.inner, self.fault = inner, fault

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, header, payload):
        middle = min(1, header.count - 1)
        if self.fault == "corrupt" and header.index == 0:
            damaged = bytearray(bytes(payload))
            damaged[header.tensors[0].offset] ^= 0x10
            payload = memoryview(damaged)
        elif self.fault == "hang" and header.index == middle:
            time.sleep(HANG_S)
            raise TransportError("fault injection: the trainer hung mid-version")
        elif self.fault == "drop" and header.index == middle:
            self._drop(header, payload)
            raise TransportError("fault injection: connection dropped mid-bucket")
        self.inner.send(header, payload)

    def _drop(self, header, payload) -> None:
        from transports.http import BUCKET_PATH, HEADER
        from transports.wire import encode_header

        meta = base64.b64encode(encode_header(header)).decode()
        for host, port in self.inner.endpoints:
            head = (f"PUT {BUCKET_PATH} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: {len(payload)}\r\n"
                    f"Authorization: Bearer {self.inner.token}\r\n{HEADER}: {meta}\r\n\r\n").encode()
            with socket.create_connection((host, port), timeout=10) as sock:
                sock.sendall(head + bytes(payload[: len(payload) // 2]))
            # closed here: the engine's receiver sees the body end early


def wrap(sender, fault: str) -> FaultySender:
    return FaultySender(sender, fault)
