"""The link between the orchestrator and its trainer process: msgspec messages over ZMQ PAIR.

The orchestrator binds a PAIR socket on tcp://127.0.0.1 (a random port) and starts the trainer
with `--connect ADDR`; only the trainer's rank 0 connects. Every message is one msgpack frame of
a tagged Struct (tag field "type"), decoded through one Decoder of the union of all of them.

    orchestrator -> trainer   Batch(step, samples) | Stop()
    trainer -> orchestrator   Replaying(...) before each journaled step a resume trains again,
                              Ready(...) once, then per Batch: StepDone(...) or Failed(...)

Bind a new `TrainerLink` for every trainer process you start: a PAIR socket talks to one peer,
and a fresh socket guarantees nothing queued for a dead trainer is delivered to its successor.
Token ids and float arrays travel as little-endian bytes (`pack_i32`, `pack_f32`, ...).
"""

from __future__ import annotations

import msgspec
import numpy as np
import zmq

from orchestrator.errors import InflightError


class Sample(msgspec.Struct, frozen=True):
    rollout_id: int
    group_id: int
    prompt_token_ids: bytes  # int32 little-endian
    completion_token_ids: bytes  # int32 little-endian
    logprobs: bytes  # float32 little-endian: the engine's logprob of each sampled completion token
    reward: float
    dispatched_version: int
    # A multi-turn episode: int32 (start, end) pairs of completion tokens the environment wrote;
    # their logprobs are NaN (none exists) and the loss leaves them out (context only).
    environment_spans: bytes = b""


class Batch(msgspec.Struct, tag="batch", tag_field="type"):
    step: int  # the optimizer step this batch is for: the trainer's done steps + 1
    samples: list[Sample]


class Stop(msgspec.Struct, tag="stop", tag_field="type"):
    pass


class Ready(msgspec.Struct, tag="ready", tag_field="type"):
    step: int  # optimizer steps done (from the checkpoint; 0 when fresh)
    version: int  # newest published version (0: the base model)
    plan_json: str  # the synchronizer's RefitPlan, RefitPlan.encode().decode()
    weights_root: str  # where versions are published: <weights_root>/vNNNNNNNN/ after COMPLETE
    pid: int
    resumed: bool  # true when the state came from a checkpoint


class Replaying(msgspec.Struct, tag="replaying", tag_field="type"):
    """A resumed trainer is about to train journaled step `step` again, the `index`-th of
    `total` (step_journal): its progress, and what restarts the orchestrator's bound on it."""

    step: int
    index: int
    total: int


class StepDone(msgspec.Struct, tag="step_done", tag_field="type"):
    step: int
    version: int | None  # the version published after this step; None when publish_every skipped it
    loss: float
    reward_mean: float
    metrics: dict[str, float]
    seconds: float
    rollout_ids: list[int]
    advantages: bytes  # float32, aligned with rollout_ids
    # float32 per rollout: mean over its tokens of (trainer logprob before the step - recorded
    # logprob), and the largest |difference|; NaN for a rollout without completion tokens.
    log_ratio_mean: bytes
    log_ratio_max_abs: bytes


class Failed(msgspec.Struct, tag="failed", tag_field="type"):
    step: int | None  # the step it failed at (None: before any step, e.g. at start-up)
    error: str


Message = Batch | Stop | Ready | Replaying | StepDone | Failed

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    try:
        return _decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise TrainerLinkError(f"undecodable message of {len(data)} bytes: {exc}") from None


def pack_i32(values) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


def pack_f32(values) -> bytes:
    return np.asarray(values, dtype="<f4").tobytes()


def unpack_i32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i4")


def unpack_f32(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<f4")


class TrainerLinkError(InflightError):
    """The link broke: an undecodable message, a send that could not be delivered."""


class TrainerLinkTimeout(TrainerLinkError, TimeoutError):
    def __init__(self, what: str, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        super().__init__(f"trainer link: no {what} within {timeout_s:g} s")


class TrainerLink:
    """The orchestrator's end (async). Uses zmq.asyncio, so it needs anyio's asyncio backend."""

    def __init__(self) -> None:
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        # close() must never wait for a trainer that is gone.
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address: str | None = None

    def bind(self) -> str:
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        return self.address

    async def send(self, msg: Message, timeout_s: float = 30.0) -> None:
        """A PAIR socket holds a message until the trainer is connected: bounded by timeout_s."""
        import anyio

        with anyio.move_on_after(timeout_s) as scope:
            await self._sock.send(encode(msg), copy=False)
        if scope.cancelled_caught:
            raise TrainerLinkTimeout(f"delivery of {type(msg).__name__}", timeout_s)

    async def recv(self, timeout_s: float) -> Message:
        import anyio

        with anyio.move_on_after(timeout_s) as scope:
            return decode(await self._sock.recv(copy=True))
        assert scope.cancelled_caught
        raise TrainerLinkTimeout("message from the trainer", timeout_s)

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class TrainerClient:
    """The trainer's end (blocking; rank 0 only)."""

    def __init__(self) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PAIR)
        # Messages to an orchestrator that died are dropped after a short linger at exit.
        self._sock.setsockopt(zmq.LINGER, 2000)

    def connect(self, address: str) -> None:
        self._sock.connect(address)

    def send(self, msg: Message, timeout_s: float = 30.0) -> None:
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        try:
            self._sock.send(encode(msg), copy=False)
        except zmq.Again:
            raise TrainerLinkTimeout(f"delivery of {type(msg).__name__}", timeout_s) from None

    def recv(self, timeout_s: float | None = None) -> Message:
        """The next message; None waits without limit (the trainer's loop polls with a timeout
        so that it notices an orchestrator that is gone)."""
        if timeout_s is not None and not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TrainerLinkTimeout("message from the orchestrator", timeout_s)
        return decode(self._sock.recv(copy=True))

    def close(self) -> None:
        self._sock.close()
        self._ctx.term()
