"""The weight-synchronizer interface (`WeightSynchronizer`, the contract a training loop drives),
the colocated device hand-over hooks, and `TransportSynchronizer`: one `WeightSynchronizer`
over any sender and vLLM's control plane.

    init_communicator()            once, after engine workers exist
    mark_stale()                   after every optimizer step
    is_stale                       true between mark_stale() and the next successful sync
    sync_weights(kv_scales=None)   transfer the latest weights (only the collective forwards kv_scales)
    shutdown()                     release communication resources
    prepare_refit_info()           {hf_name: (shape, dtype)} the producer packs and the consumer unpacks


Two ways to make a version live. Simple mode (engines given, `apply_on_finish`): per version, for
every engine: `start_weight_update()`, then `update_weights({"version": v})`
on a thread (its receiver waits for the buckets) while this thread packs and sends them, then
`finish_weight_update(str(v))`. If any engine fails, the others are told to discard the
version (`update_weights({"version": v, "discard": True})`) before finishing, so no engine
makes it live. Each engine makes it live at its own moment: this mode is NOT atomic across
engines (a request on one engine may sample v while another still samples v-1). Coordinated
mode (no engines given: `create_weight_synchronizer(engines=[], engine_count=n, ...)`):
`sync_weights()` only sends; every engine stages what arrives through its swap worker
extension (`transports.swap`, the same staging path) and `orchestrator.fleet.fleet.Fleet.activate`
makes the version live on every engine at one instant. Colocated transports run the device
hand-over hooks around the refit.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from transports.errors import TransportConfigError, TransportError, TransportTimeoutError
from transports.protocols import BucketSender, EngineWeightControl
from transports.wire import BucketHeader, RefitInfo

if TYPE_CHECKING:
    import torch

    from transports.refit.plan import RefitPlan

log = structlog.get_logger("transports.synchronizer")

# ---------------------------------------------------------------------------------------------
# colocated device hand-over


@dataclass
class DeviceHandoverHooks:
    """What a colocated transport does with the shared device around a refit.

    The trainer and the engine share one device; a refit needs room on it for the engine's
    new weights, so the optimizer state moves out first and the engine is readied after.
    """

    offload_optimizer: Callable[[], None] = lambda: None
    prepare_for_generation: Callable[[], None] = lambda: None
    offload_after_refit: Callable[[], None] = lambda: None
    calls: list[str] = field(default_factory=list)

    def run(self, name: str) -> None:
        self.calls.append(name)
        getattr(self, name)()


def engine_memory_fraction(colocated: bool, max_colocated_worker_groups: int = 1) -> float:
    """Share of the device an engine claims: a dedicated engine takes all of it; a colocated
    one leaves room for the trainer's worker groups."""
    if not colocated:
        return 1.0
    return min(0.2, 1.0 / max(1, max_colocated_worker_groups))


# ---------------------------------------------------------------------------------------------
# the synchronizer


StateDictFn = Callable[[], Mapping[str, "torch.Tensor"]]


class WeightSynchronizer(abc.ABC):
    """Moves the trainer's latest weights into every engine; the training loop drives it."""

    transport_name: str = "abstract"
    forwards_kv_scales: bool = False

    def __init__(self, plan: RefitPlan, state_dict: StateDictFn):
        self.plan = plan
        self._state_dict = state_dict
        self._stale = False
        self._version = 0
        self._lock = threading.Lock()

    # -- contract ---------------------------------------------------------------------------

    @abc.abstractmethod
    def init_communicator(self) -> None:
        """Called once after engine workers exist."""

    def mark_stale(self) -> None:
        with self._lock:
            self._stale = True
            self._version += 1

    @property
    def is_stale(self) -> bool:
        return self._stale

    @property
    def version(self) -> int:
        return self._version

    def sync_weights(self, kv_scales: Mapping[str, float] | None = None) -> int:
        """Transfers the latest weights; returns the version sent. Stays stale on failure."""
        if kv_scales is not None and not self.forwards_kv_scales:
            # Only the collective path carries kv_scales (FP8 KV cache calibration); the others
            # would silently drop them, which is worse than refusing.
            raise TransportConfigError(f"the {self.transport_name} transport does not forward kv_scales")
        version = self._version
        self._transfer(version, dict(kv_scales) if kv_scales is not None else None)
        with self._lock:
            if self._version == version:
                self._stale = False
        return version

    @abc.abstractmethod
    def _transfer(self, version: int, kv_scales: dict[str, float] | None) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    def prepare_refit_info(self) -> RefitInfo:
        return self.plan.refit_info()

    # -- helpers ----------------------------------------------------------------------------

    def _buckets(self, version: int, kv_scales: dict[str, float] | None = None) -> Iterable[tuple[BucketHeader, memoryview]]:
        return self.plan.pack(self._state_dict(), version=version, kv_scales=kv_scales)


# ---------------------------------------------------------------------------------------------
# one synchronizer over any sender


def run_alongside(calls: Sequence[Callable[[], Any]], main: Callable[[], Any], timeout_s: float, what: str) -> None:
    """Runs each of `calls` on its own thread while `main` runs here; waits for all of them
    within `timeout_s` of `main` ending and raises the most telling error."""
    errors: list[BaseException | None] = [None] * len(calls)

    def wrap(i: int, call: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            try:
                call()
            except BaseException as exc:  # re-raised on the caller's thread below
                errors[i] = exc
        return run

    threads = [threading.Thread(target=wrap(i, c), name=f"inflight-{what}-{i}", daemon=True) for i, c in enumerate(calls)]
    for t in threads:
        t.start()
    main_error: BaseException | None = None
    try:
        main()
    except BaseException as exc:
        main_error = exc
    deadline = time.monotonic() + timeout_s
    for i, t in enumerate(threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive() and errors[i] is None:
            errors[i] = TransportTimeoutError(f"{what} on engine {i}", timeout_s)
    # An engine's own error is the root cause (a tensor it rejected); the sender's is often a
    # consequence of it (a peer that stopped listening), so engines' errors go first.
    for error in errors:
        if error is not None and not isinstance(error, TransportTimeoutError):
            raise error
    if main_error is not None:
        raise main_error
    for error in errors:
        if error is not None:
            raise error


class TransportSynchronizer(WeightSynchronizer):
    def __init__(
        self,
        *,
        transport_name: str,
        plan: RefitPlan,
        state_dict: StateDictFn,
        sender: BucketSender,
        engines: Sequence[EngineWeightControl],
        timeout_s: float = 60.0,
        checksums: bool = True,
        hooks: DeviceHandoverHooks | None = None,
        forwards_kv_scales: bool = False,
        apply_on_finish: bool = True,
        sender_factory: Callable[[], BucketSender] | None = None,
    ):
        super().__init__(plan, state_dict)
        self.transport_name = transport_name
        self.sender = sender
        self.engines = list(engines)
        self.timeout_s = timeout_s
        self.checksums = checksums
        self.hooks = hooks
        self.forwards_kv_scales = forwards_kv_scales
        self.apply_on_finish = apply_on_finish
        self._connected = False
        self._attempt = 0
        self._arenas = None
        self._sender_factory = sender_factory
        self._excluded: set[int] = set()  # engine indices left out of every version (exclude_engine)

    @property
    def colocated(self) -> bool:
        return self.hooks is not None

    def engine_init_info(self, engine_index: int) -> dict[str, Any]:
        return {"plan": self.plan.encode().decode(), "apply_on_finish": self.apply_on_finish,
                "transport": self.transport_name,
                "options": {"timeout_s": self.timeout_s, **self.sender.engine_init_info(engine_index)}}

    def init_communicator(self) -> None:
        calls = [lambda e=e, i=i: e.init_weight_transfer_engine(self.engine_init_info(i))
                 for i, e in enumerate(self.engines) if i not in self._excluded]
        run_alongside(calls, self.sender.connect, self.timeout_s, "init_weight_transfer_engine")
        self._connected = True
        log.info("synchronizer.ready", transport=self.transport_name, engines=len(self.engines),
                 buckets=self.plan.bucket_count, wire_bytes=self.plan.wire_bytes)

    def exclude_engine(self, engine_index: int) -> None:
        """Leave engine `engine_index` out of every version from the next one on: an engine the
        fleet fenced (dead, or out of step) must not fail every later `sync_weights` of the
        others (ipc awaits each engine's acknowledgement, http each engine's answer). The
        filesystem needs nothing (engines read committed versions at their own pace); the
        collective broadcasts to every rank of its group, so it refuses: `reconnect()` with a
        group of the engines left is the way there. Call between versions."""
        self._set_excluded(engine_index, True)

    def include_engine(self, engine_index: int) -> None:
        """Send to engine `engine_index` again from the next version on (a restarted engine;
        its receiver connects again with the same `engine_init_info(i)`)."""
        self._set_excluded(engine_index, False)

    def _set_excluded(self, engine_index: int, excluded: bool) -> None:
        if self.transport_name != "filesystem":
            method = getattr(self.sender, "exclude" if excluded else "include", None)
            if method is None:
                raise TransportConfigError(
                    f"the {self.transport_name} transport cannot leave an engine out of a version: it sends "
                    "to every rank of its group at once; reconnect() with a group of the engines left")
            method(engine_index)
        elif engine_index < 0:
            raise TransportError(f"engine index {engine_index} is negative")
        if excluded:
            self._excluded.add(engine_index)  # its update session (apply_on_finish) is skipped too
        else:
            self._excluded.discard(engine_index)

    def reconnect(self) -> None:
        """Replaces the sender with a fresh one (a collective group broken by a failed version
        needs a new rendezvous); call `init_communicator()` next, while the engines are handed
        the new `engine_init_info(i)` (a fleet: `Fleet.setup(..., engine_options=...)`)."""
        if self._sender_factory is None:
            raise TransportConfigError("this synchronizer was built without a sender factory")
        self.sender.close()
        self.sender = self._sender_factory()
        self._connected = False
        exclude = getattr(self.sender, "exclude", None)
        for index in sorted(self._excluded) if exclude is not None else ():
            exclude(index)  # the engines left out stay out

    def _transfer(self, version: int, kv_scales: dict[str, float] | None) -> None:
        if not self._connected:
            raise TransportError("init_communicator() was not called")
        if self.hooks:
            self.hooks.run("offload_optimizer")
        started = time.perf_counter()
        # begin() before any engine starts waiting: a retried version must not be mistaken
        # for the failed attempt still on disk (filesystem) or in flight.
        self.sender.begin(version, self.plan.bucket_count)
        self._attempt += 1
        # Packing starts now, on its thread, while the engines are told to expect a version.
        buckets = self.plan.pack(self._state_dict(), version=version, kv_scales=kv_scales, checksums=self.checksums,
                                 arenas=self._pack_arenas(), attempt=self._attempt,
                                 hold=getattr(self.sender, "in_flight", 0))
        # closing(): on a failed send the packing thread stops now, before the arenas are reused.
        engines = self._active_engines()
        with contextlib.closing(buckets):
            for engine in engines:
                engine.start_weight_update()
            info = {"version": version, "attempt": self._attempt}
            calls = [lambda e=e: e.update_weights(info) for e in engines]
            try:
                run_alongside(calls, lambda: self._send(version, buckets), self.timeout_s, "update_weights")
            except BaseException:
                buckets.close()
                self._discard(version)
                raise
        for engine in engines:
            engine.finish_weight_update(str(version))
        if self.hooks:
            self.hooks.run("prepare_for_generation")
            self.hooks.run("offload_after_refit")
        log.info("synchronizer.synced", transport=self.transport_name, version=version,
                 seconds=round(time.perf_counter() - started, 4))

    def _pack_arenas(self):
        """The sender's own arenas (ipc packs straight into shared memory), else two kept
        across versions: no allocation and no page faults per version."""
        arenas = getattr(self.sender, "arenas", None)
        own = arenas() if arenas is not None else None
        if own is not None:
            return own
        if self._arenas is None:
            import torch

            self._arenas = [torch.empty(self.plan.arena_bytes, dtype=torch.uint8) for _ in range(2)]
        return self._arenas

    def _send(self, version: int, buckets) -> None:
        with contextlib.closing(buckets):
            for header, payload in buckets:
                self.sender.send(header, payload)
        self.sender.commit(version)

    def _active_engines(self) -> list[EngineWeightControl]:
        return [e for i, e in enumerate(self.engines) if i not in self._excluded]

    def _discard(self, version: int) -> None:
        """Closes every engine's update session without making the version live."""
        for engine in self._active_engines():
            try:
                engine.update_weights({"version": version, "discard": True})
            except Exception:
                pass  # that engine's session already ended with its own error
            try:
                engine.finish_weight_update(None)
            except Exception:
                pass

    def shutdown(self) -> None:
        self.sender.close()
        self._connected = False
        self._arenas = None
