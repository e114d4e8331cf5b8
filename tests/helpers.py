"""Helpers shared by tests (one copy of each): a free TCP port, every safetensors file of a
directory, a raw HTTP exchange over a socket."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (bind to port 0, read it, release it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def load_safetensors_dir(path):
    """Every tensor of every `*.safetensors` file in `path` (the engine side's own reader)."""
    from transports.lora import load_safetensors_dir as load

    return load(path)


def raw_http(host: str, port: int, request: bytes, timeout_s: float = 5.0) -> tuple[int, bytes]:
    """Sends `request` as it is on a fresh connection; returns the answer's status and the
    raw bytes read until the server closed the connection or stopped answering."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        sock.sendall(request)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    if not data.startswith(b"HTTP/"):
        return 0, data
    return int(data.split(b" ", 2)[1]), data
