"""LoRA versions on the fleet (the `adapter` activation strategy): each version v >= 1 is a
PEFT adapter directory the trainer published (RUN_DIR/weights/vNNNNNNNN/); version 0 is the
base model (no adapter).

Staging a version loads its adapter on an engine beside the ones serving, under a name unique
to that version (`inflight-v<v>`: vLLM keys its prefix cache by adapter name and path, so no
cached block crosses versions); the engines keep generating. Once every engine holds it, the
coordinator makes it live: from then on every new request names it, while requests in flight
finish on the adapter they started with, so every rollout has exactly one version. An adapter
is unloaded once it is not live and no request on that engine names it; at most `max_loras`
are loaded per engine: a stage waits (within the stage timeout) for a request under an old
adapter to end when they are all in use. Before the first engine loads it, the adapter's files
are checked once (`transports.adapters.check_adapter`): a corrupt file fails the stage with an
error naming the tensor, and no engine activates that version.

A mixin of `Fleet` (it uses the fleet's `engines`, `tracks`, `coordinator` and `ft`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import anyio

from orchestrator.activation import coordinator as act
from orchestrator.engines.base import AdapterRef, Engine
from orchestrator.observe.logging import get_logger

log = get_logger(__name__)


def adapter_name(version: int) -> str:
    return f"inflight-v{version}"


@dataclass(frozen=True)
class AdapterStore:
    """Where versions' adapters are (`root`/vNNNNNNNN) and how many an engine may hold."""

    root: Path
    max_loras: int

    def ref(self, version: int) -> AdapterRef | None:
        if version == 0:
            return None
        return AdapterRef(name=adapter_name(version), int_id=version, path=str(self.root / f"v{version:08d}"))


class AdapterStaging:
    """Stage, drop and retire adapters; name the adapter of each request."""

    def init_adapters(self, store: AdapterStore | None) -> None:
        self.adapter_store = store
        self.resident: dict[str, dict[int, AdapterRef]] = {}  # engine -> version -> adapter loaded there
        self._checked: dict[int, str | None] = {}  # version -> why its files are refused (None: sound)
        # Users of adapters besides the fleet's own requests (a benchmark's load that streams
        # from the engine directly): engine id -> versions in use there.
        self.adapter_users: list = []

    def request_adapter(self, version: int) -> AdapterRef | None:
        """The adapter a request dispatched under `version` names (None: the base model)."""
        if self.adapter_store is None:
            return None
        return self.adapter_store.ref(version)

    async def _stage_adapter(self, engine: Engine, a: act.Stage) -> act.Event:
        e = engine.engine_id
        ref = self.request_adapter(a.version)
        if self.adapter_store is None:
            raise RuntimeError("strategy 'adapter' needs the fleet's adapter store")
        if ref is None or a.version in self.resident.get(e, {}):
            return act.Staged(engine=e, at=time.monotonic(), version=a.version)
        refused = await self._check_files(a.version, ref)
        if refused is not None:
            return act.StageFailed(engine=e, at=time.monotonic(), version=a.version, error=refused)
        while not await self._make_room(engine):  # bounded by the coordinator's stage timer
            await anyio.sleep(self.ft.poll_s * 5)
        # Held from before the call: a stage cancelled mid-load (another engine failed first)
        # may still have loaded it, and the drop that follows must unload it.
        self.resident.setdefault(e, {})[a.version] = ref
        try:
            await engine.load_adapter(ref)
        except Exception:
            self.resident[e].pop(a.version, None)  # refused: the engine holds nothing of it
            raise
        except BaseException:
            # Cancelled mid-load: the activation ended (another engine failed first) and its
            # drop may have come before this load reached the engine, which may still load it.
            with anyio.CancelScope(shield=True), anyio.move_on_after(self.ft.rpc_s):
                await self._unload_quietly(engine, a.version)
            raise
        log.info("fleet.adapter_loaded", engine=e, version=a.version, adapter=ref.name)
        return act.Staged(engine=e, at=time.monotonic(), version=a.version)

    async def _check_files(self, version: int, ref: AdapterRef) -> str | None:
        """Checked once per version, off the event loop (the files are read whole)."""
        if version not in self._checked:
            from transports.adapters import check_adapter
            from transports.errors import AdapterError

            try:
                await anyio.to_thread.run_sync(check_adapter, ref.path)
                self._checked[version] = None
            except AdapterError as exc:
                self._checked[version] = f"{type(exc).__name__}: {exc}"
        return self._checked[version]

    def _in_use(self, engine_id: str) -> set[int]:
        """Versions an engine must keep: live, and named by a request in flight there."""
        used = {t.dispatched_version for t in self.tracks_on(engine_id)}
        for user in self.adapter_users:
            used |= user(engine_id)
        return used | {self.live_version}

    async def _make_room(self, engine: Engine) -> bool:
        """Unload what no request uses until one more fits; False when all are in use."""
        assert self.adapter_store is not None
        held = self.resident.get(engine.engine_id, {})
        if len(held) < self.adapter_store.max_loras:
            return True
        for version in sorted(set(held) - self._in_use(engine.engine_id)):
            await self._unload(engine, version)
            if len(held) < self.adapter_store.max_loras:
                return True
        return False

    async def _drop_adapter(self, engine_id: str, version: int) -> None:
        """A stage rolled back: unload it there unless something uses it."""
        if version in self.resident.get(engine_id, {}) and version not in self._in_use(engine_id):
            await self._unload(self.engines[engine_id], version)

    async def _retire_adapters(self) -> None:
        """After an activation: unload every adapter older than the live one that no request
        in flight names (shielded: it runs in an activation's cleanup)."""
        if self.strategy != "adapter":
            return
        # Versions before the live one are never staged again: their file checks are not needed.
        self._checked = {v: why for v, why in self._checked.items() if v >= self.live_version}
        with anyio.CancelScope(shield=True), anyio.move_on_after(self.ft.rpc_s):
            for engine_id, held in list(self.resident.items()):
                if engine_id in self.coordinator.fenced:
                    continue
                for version in sorted(v for v in set(held) - self._in_use(engine_id) if v < self.live_version):
                    if not await self._unload_quietly(self.engines[engine_id], version):
                        break

    async def _unload_quietly(self, engine: Engine, version: int) -> bool:
        try:
            await self._unload(engine, version)
            return True
        except Exception as exc:  # noqa: BLE001 - a dead engine holds nothing
            log.warning("fleet.adapter_unload_failed", engine=engine.engine_id, version=version, error=str(exc))
            return False

    async def _unload(self, engine: Engine, version: int) -> None:
        # Forgotten even when the call fails: an engine that cannot unload it (it never got it, or
        # died) must not keep it counted against max_loras forever.
        ref = self.resident.get(engine.engine_id, {}).pop(version, None)
        if ref is None:  # unloaded already (a drop and a cancelled stage both ask)
            return
        await engine.unload_adapter(ref)
        log.info("fleet.adapter_unloaded", engine=engine.engine_id, version=version, adapter=ref.name)


PROBE_ID = 2**31 - 1  # an int id no version takes


async def probe_targets(engines, model_dir: str, lora, scratch: Path) -> None:
    """Load a zero adapter with the run's targets and rank on every engine, then unload it:
    targets the engine cannot serve (vLLM's LoRA covers a family's linear layers, not always
    its output head) are refused now, naming trainer.lora.target_modules, not after the first
    trainer step as an activation that fails."""
    from orchestrator.errors import ConfigError, EngineError

    path = await anyio.to_thread.run_sync(_write_probe, model_dir, lora, scratch)
    ref = AdapterRef(name="inflight-probe", int_id=PROBE_ID, path=str(path))
    try:
        for engine in engines:
            try:
                await engine.load_adapter(ref)
            except EngineError as exc:
                raise ConfigError("trainer.lora.target_modules",
                                  f"{list(lora.target_modules)}: {engine.engine_id} cannot serve an adapter on these "
                                  f"modules: {exc}") from None
            await engine.unload_adapter(ref)
    finally:
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def _write_probe(model_dir: str, lora, scratch: Path) -> Path:
    """A rank-`lora.rank` adapter of zeros on every module the targets name (shapes read from
    the safetensors headers, no weights loaded)."""
    import json
    import shutil

    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shapes[name] = list(f.get_slice(name).get_shape())
    tensors = {}
    for name, shape in shapes.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and len(shape) == 2 and module.rsplit(".", 1)[-1] in lora.target_modules:
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.zeros(lora.rank, shape[1])
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.zeros(shape[0], lora.rank)
    out = Path(scratch) / "lora-probe"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "target_modules": list(lora.target_modules), "bias": "none", "lora_dropout": 0.0,
              "fan_in_fan_out": False, "use_rslora": False, "use_dora": False, "base_model_name_or_path": model_dir}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out
