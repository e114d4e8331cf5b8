"""Helpers shared by tests (one copy of each): a free TCP port, every safetensors file of a
directory, a raw HTTP exchange over a socket, a sender that damages buckets on their way
out (fault injection), a two-layer model's versions with their refit plan (staging tests), and
an in-process vLLM engine with the inflight weight-transfer backend."""

from __future__ import annotations

import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (bind to port 0, read it, release it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def core_of(index: int) -> str:
    """The `index`-th core this process may run on, wrapping (`engine.cpu_bind` of a test's second
    server: its own core instead of the first's)."""
    cores = sorted(os.sched_getaffinity(0))
    return str(cores[index % len(cores)])


def attach_to(url: str) -> str:
    """The `[engine]` lines (after `model = ...`) that attach an `inflight run` to the server at
    `url` (the session's `run_server` fixture) instead of starting an engine of its own."""
    return f'kind = "server"\nurl = "{url}"\n'


def inflight_llm(model_dir, **kwargs):
    """An in-process vLLM engine (fp32, eager, one process) whose weights the project's
    transports update (`transports.vllm_backend`); `kwargs` override or add engine arguments."""
    import os

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    import transports.vllm_backend  # noqa: F401  (registers the backends in this process)

    args = dict(dtype="float32", enforce_eager=True, seed=0, max_model_len=128, distributed_executor_backend="uni",
                weight_transfer_config={"backend": "inflight"},
                worker_extension_cls="transports.vllm_backend.InflightWorkerExtension")
    return LLM(model=str(model_dir), **{**args, **kwargs})


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


class CorruptingSender:
    """Wraps a real bucket sender and damages the first bucket of every version on its way out,
    after its checksums were computed (fault injection). `fault`:

    * "checksum" (default): flips bits (`mask`) of bucket 0's first byte of tensor 0;
    * "shape" / "dtype": the header lies about tensor 0's shape (reversed) or dtype (float16);
    * "missing": the header leaves tensor 0 out;
    * "truncated": the payload stops 4 bytes into the last tensor.
    """

    def __init__(self, inner, fault: str = "checksum", mask: int = 0x10):
        self.inner, self.fault, self.mask = inner, fault, mask

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def send(self, header, payload):
        if header.index == 0:
            header, payload = self.damage(header, payload)
        self.inner.send(header, payload)

    def damage(self, header, payload):
        import msgspec

        first = header.tensors[0]
        if self.fault == "shape":
            header = msgspec.structs.replace(
                header, tensors=(msgspec.structs.replace(first, shape=tuple(reversed(first.shape))),) + header.tensors[1:])
        elif self.fault == "dtype":
            header = msgspec.structs.replace(
                header, tensors=(msgspec.structs.replace(first, dtype="float16"),) + header.tensors[1:])
        elif self.fault == "missing":
            header = msgspec.structs.replace(header, tensors=header.tensors[1:])
        elif self.fault == "truncated":
            payload = payload[: header.tensors[-1].offset + 4]
        elif self.fault == "checksum":
            damaged = bytearray(payload)
            damaged[first.offset] ^= self.mask
            payload = memoryview(damaged)
        else:
            raise ValueError(f"unknown fault {self.fault!r}")
        return header, payload


def tiny_model():
    """A two-linear-layer model (8 -> 8 -> 4), parameters `proj.*` and `out.*`."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)
            self.out = torch.nn.Linear(8, 4)

    return Tiny()


def tiny_state(seed: int) -> dict:
    """Version `seed` of `tiny_model`'s weights: fp32 tensors by name."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(v.shape, generator=g) for k, v in tiny_model().state_dict().items()}


def tiny_plan(bucket_bytes: int = 256):
    """The refit plan of `tiny_state`: fp32 on the wire (exact), several buckets."""
    from transports.refit.plan import RefitPlan

    meta = {k: (tuple(v.shape), v.dtype) for k, v in tiny_state(0).items()}
    return RefitPlan.build(meta, wire_dtype=None, bucket_bytes=bucket_bytes)
