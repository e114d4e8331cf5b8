"""`create_weight_synchronizer(...)`: the transport chosen from topology and backend.

    backend  colocated  transport
    vllm     no         collective (gloo on CPU, NCCL on GPU)   needs train_cluster, inference_world_size
    vllm     yes        ipc (shared memory on CPU, CUDA IPC handles on GPU; ZMQ for handles)
    sglang   yes        http
    sglang   no         NotImplementedError
    any LoRA adapter    filesystem (collective or nixl asked for explicitly: refused)

`transport=` overrides the choice (filesystem, collective, ipc, http, nixl). With `engines=[]` and
`engine_count=n` the synchronizer only sends: n engines set up by a `Fleet` with
`engine_init_info(i)["options"]` stage what it sends, and the fleet's activation makes a version
live on all of them at one instant (the coordinated path; see docs/activation.md). Colocated
transports own the device hand-over around a refit (`DeviceHandoverHooks`); the collective one
only moves bytes. A colocated engine claims min(0.2, 1/max_colocated_worker_groups) of the
device, a dedicated one all of it (`engine_memory_fraction`).
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import msgspec

from transports.errors import TransportConfigError, TransportUnavailableError
from transports.protocols import EngineWeightControl
from transports.synchronizer import (
    DeviceHandoverHooks,
    StateDictFn,
    WeightSynchronizer,
    engine_memory_fraction,
)

if TYPE_CHECKING:
    import torch

    from transports.refit.maps import NameMap
    from transports.refit.plan import RefitPlan

TRANSPORTS = ("filesystem", "collective", "ipc", "http", "nixl")
Backend = Literal["vllm", "sglang"]


class TrainCluster(msgspec.Struct, frozen=True):
    """Where the trainer's rank 0 hosts the collective rendezvous."""

    host: str = "127.0.0.1"
    port: int = 0
    world_size: int = 1


class TransportChoice(msgspec.Struct, frozen=True):
    transport: str
    colocated: bool
    engine_memory_fraction: float
    reason: str


def choose_transport(
    *,
    backend: Backend = "vllm",
    colocated: bool,
    lora: bool = False,
    transport: str | None = None,
    train_cluster: TrainCluster | None = None,
    inference_world_size: int | None = None,
    max_colocated_worker_groups: int = 1,
) -> TransportChoice:
    """The pure decision table (see the module docstring)."""
    fraction = engine_memory_fraction(colocated, max_colocated_worker_groups)
    if transport is not None and transport not in TRANSPORTS:
        raise TransportConfigError(f"unknown transport {transport!r}; choose one of {', '.join(TRANSPORTS)}")
    if backend not in ("vllm", "sglang"):
        raise TransportConfigError(f"unknown backend {backend!r}; choose vllm or sglang")
    if lora:
        if transport in ("collective", "nixl"):
            raise TransportConfigError(
                f"a LoRA adapter is trained: the {transport} transport moves full weights only; "
                "use transport='filesystem' (or leave it unset) so the adapter is published as a versioned file")
        return TransportChoice(transport or "filesystem", colocated, fraction,
                               "LoRA adapter: versioned adapter files")
    if backend == "sglang" and not colocated:
        raise NotImplementedError("non-colocated SGLang weight sync is not implemented; "
                                  "colocate the engines (HTTP transport) or use vLLM")
    if transport == "nixl":
        from transports.nixl import nixl_unavailable_reason

        reason = nixl_unavailable_reason()
        if reason:
            raise TransportUnavailableError(f"nixl transport unavailable: {reason}")
    if not colocated and (transport is None or transport == "collective"):
        missing = [n for n, v in (("train_cluster", train_cluster), ("inference_world_size", inference_world_size))
                   if v is None]
        if missing:
            raise TransportConfigError(
                f"non-colocated weight sync needs {' and '.join(missing)}: the collective group spans the "
                "trainer and every engine worker")
        if inference_world_size is not None and inference_world_size < 1:
            raise TransportConfigError(f"inference_world_size must be >= 1, got {inference_world_size}")
    if transport is not None:
        return TransportChoice(transport, colocated, fraction, "asked for explicitly")
    if backend == "sglang":
        return TransportChoice("http", True, fraction, "colocated SGLang: HTTP")
    if colocated:
        return TransportChoice("ipc", True, fraction, "colocated vLLM: IPC")
    return TransportChoice("collective", False, fraction, "dedicated vLLM engines: collective")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def create_weight_synchronizer(
    *,
    state_dict: StateDictFn,
    engines: Sequence[EngineWeightControl],
    colocated: bool,
    backend: Backend = "vllm",
    transport: str | None = None,
    lora: bool = False,
    train_cluster: TrainCluster | None = None,
    inference_world_size: int | None = None,
    max_colocated_worker_groups: int = 1,
    plan: RefitPlan | None = None,
    name_map: NameMap | None = None,
    bucket_bytes: int | None = None,
    wire_dtype: torch.dtype | None | str = "bfloat16",
    target_dtype: torch.dtype | None = None,
    hooks: DeviceHandoverHooks | None = None,
    filesystem_root: str | Path | None = None,
    keep_last: int = 3,
    http_endpoints: Sequence[tuple[str, int]] | None = None,
    timeout_s: float = 60.0,
    checksums: bool = True,
    device: str = "cpu",
    engine_count: int | None = None,
) -> WeightSynchronizer:
    """Builds the refit plan (unless given) from `state_dict()`'s metadata and the chosen
    transport's sender. Call `init_communicator()` once the engines exist. `engine_count`: how
    many engines the sender serves when `engines` is empty (a fleet activates versions)."""
    if engines and engine_count is not None and engine_count != len(engines):
        raise TransportConfigError(f"engine_count={engine_count} disagrees with {len(engines)} engines")
    count = len(engines) or engine_count or 0
    choice = choose_transport(backend=backend, colocated=colocated, lora=lora, transport=transport,
                              train_cluster=train_cluster, inference_world_size=inference_world_size,
                              max_colocated_worker_groups=max_colocated_worker_groups)
    if plan is None:
        plan = _build_plan(state_dict, name_map, bucket_bytes, wire_dtype, target_dtype)
    from transports.synchronizer import TransportSynchronizer

    name = choice.transport
    if filesystem_root is None and name == "filesystem":
        filesystem_root = Path(tempfile.mkdtemp(prefix="inflight-weights-"))

    def new_sender():
        return _make_sender(name, plan=plan, engines=count, train_cluster=train_cluster,
                            inference_world_size=inference_world_size, filesystem_root=filesystem_root,
                            keep_last=keep_last, http_endpoints=http_endpoints, timeout_s=timeout_s, device=device)

    colocated_hooks = (hooks or DeviceHandoverHooks()) if choice.colocated and name != "collective" else None
    return TransportSynchronizer(transport_name=name, plan=plan, state_dict=state_dict, sender=new_sender(),
                                 engines=engines, timeout_s=timeout_s, checksums=checksums, hooks=colocated_hooks,
                                 forwards_kv_scales=(name == "collective"), sender_factory=new_sender)


def _build_plan(state_dict: StateDictFn, name_map, bucket_bytes, wire_dtype, target_dtype) -> RefitPlan:
    import torch

    from transports.refit.plan import DEFAULT_BUCKET_BYTES, RefitPlan

    if isinstance(wire_dtype, str):
        wire_dtype = getattr(torch, wire_dtype)
    meta = {k: (tuple(v.shape), v.dtype) for k, v in state_dict().items()}
    return RefitPlan.build(meta, name_map, bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
                           wire_dtype=wire_dtype, target_dtype=target_dtype)


def _make_sender(name: str, *, plan: RefitPlan, engines: int, train_cluster: TrainCluster | None,
                 inference_world_size: int | None, filesystem_root, keep_last: int,
                 http_endpoints: Sequence[tuple[str, int]] | None, timeout_s: float, device: str):
    if name == "filesystem":
        from transports.filesystem import FilesystemSender

        root = Path(filesystem_root) if filesystem_root else Path(tempfile.mkdtemp(prefix="inflight-weights-"))
        return FilesystemSender(root, keep_last=keep_last)
    if name == "collective":
        from transports.collective import CollectiveSender

        cluster = train_cluster or TrainCluster()
        workers = inference_world_size or engines
        return CollectiveSender(engine_workers=workers, workers_per_engine=max(1, workers // max(1, engines)),
                                host=cluster.host, port=cluster.port, timeout_s=timeout_s,
                                arena_bytes=plan.arena_bytes if device == "cpu" else None, device=device)
    if name == "ipc":
        from transports.ipc import IpcSender

        return IpcSender(arena_bytes=plan.arena_bytes, engines=engines, timeout_s=timeout_s, device=device)
    if name == "http":
        from transports.http_sender import HttpSender

        endpoints = list(http_endpoints) if http_endpoints else [("127.0.0.1", _free_port("127.0.0.1"))
                                                                 for _ in range(engines)]
        return HttpSender(endpoints=endpoints, timeout_s=timeout_s)
    if name == "nixl":
        raise TransportUnavailableError("nixl transport: the nixl package imports, but the one-sided read path "
                                        "is not implemented in this build")
    raise TransportConfigError(f"unknown transport {name!r}")


def state_dict_fn(tensors: Mapping[str, torch.Tensor]) -> StateDictFn:
    return lambda: tensors
