"""Shared by the activation tests: publishing versions, reference logprobs per token version
(full recompute, or keys/values carried across the switch), load generation and a
hand-written fault injector around a real engine."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Sequence

import anyio
import torch

from orchestrator.engines.base import Engine, SamplingSettings
from orchestrator.errors import FencedEngineError
from replay.analysis.recompute import carried_logprobs, fed_logprobs, sequence_logprobs

PROMPTS = [[5, 17, 42, 8, 23, 11, 3, 29] * 3, [7, 7, 19, 4, 61, 2, 33, 12] * 3,
           [9, 41, 6, 28, 14, 50, 3, 21] * 3, [12, 3, 5, 44, 8, 16, 27, 31] * 3]
LOAD = SamplingSettings(temperature=1.0, max_tokens=420, ignore_eos=True)


def load_checkpoint(model_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(glob.glob(os.path.join(str(model_dir), "*.safetensors"))):
        state.update(load_file(f))
    return state


def perturbed(state: dict[str, torch.Tensor], seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v + scale * v.std().clamp(min=0.02) * torch.randn(v.shape, generator=g)).contiguous()
            for k, v in state.items()}


class Publisher:
    """The trainer side of the filesystem transport, fp32 on the wire (exact weights)."""

    def __init__(self, root, base: dict[str, torch.Tensor]):
        from transports.refit.plan import RefitPlan

        self.root = str(root)
        self.plan = RefitPlan.build({k: (tuple(v.shape), v.dtype) for k, v in base.items()}, wire_dtype=None)
        self.plan_json = self.plan.encode().decode()
        self.versions: dict[int, dict[str, torch.Tensor]] = {}

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> None:
        from transports.filesystem import FilesystemSender

        sender = FilesystemSender(self.root, keep_last=50, fsync=False)
        sender.begin(version, self.plan.bucket_count)
        for header, payload in self.plan.pack(state, version=version):
            sender.send(header, payload)
        sender.commit(version)
        self.versions[version] = state


class References:
    """transformers fp32 models, one per weight version."""

    def __init__(self, model_dir):
        from transformers import AutoModelForCausalLM

        self.model_dir = str(model_dir)
        self._cls = AutoModelForCausalLM
        self.models: dict[int, torch.nn.Module] = {}

    def add(self, version: int, state: dict[str, torch.Tensor]) -> None:
        model = self._cls.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected
        self.models[version] = model

    def full(self, version: int, prompt: Sequence[int], tokens: Sequence[int]) -> list[float]:
        """Every position computed under `version` (what `recompute` promises)."""
        return sequence_logprobs(self.models[version], prompt, tokens)

    def recompute(self, prompt, tokens, versions) -> list[float]:
        per_version = {v: self.full(v, prompt, tokens) for v in set(versions)}
        return [per_version[v][i] for i, v in enumerate(versions)]

    def carried(self, prompt, tokens, versions) -> list[float]:
        """Keys/values kept across the switch: each position was fed (and its keys/values
        computed) under the version of the token it produced; prompt positions under that of
        token 0."""
        return carried_logprobs(self.models, prompt, tokens, versions)


def new_world(tiny_model_dir, weights_dir) -> dict:
    """What an activation test module shares: the base weights, a publisher of new versions
    (filesystem transport) and transformers references per version (v0 = the base)."""
    base = load_checkpoint(tiny_model_dir)
    refs = References(tiny_model_dir)
    refs.add(0, base)
    return {"base": base, "pub": Publisher(weights_dir, base), "refs": refs, "next": 1, "live": 0}


def publish_next(world: dict, seed_base: int) -> int:
    """Publish the next version (weights far enough from every other to change each logprob)
    and register its transformers reference; returns the version."""
    v = world["next"]
    world["next"] += 1
    state = perturbed(world["base"], seed=seed_base + v)
    world["pub"].publish(v, state)
    world["refs"].add(v, state)
    return v


def max_err(a: Sequence[float], b: Sequence[float]) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


async def under_load(fleet, activate: Callable, *, n: int = 4, min_tokens: int = 6,
                     sampling: SamplingSettings = LOAD, engines: Sequence[str] | None = None):
    """Continuous load: n streams of rollouts through the fleet, each starting a new rollout
    when one ends, until `activate()` (called once every stream produced `min_tokens`)
    returned. Returns (every completion, activate's result)."""
    completions: list = []
    result: dict = {}
    done = anyio.Event()

    async def stream(i: int) -> None:
        engine_id = engines[i % len(engines)] if engines else None
        k = 0
        while True:
            try:
                c = await fleet.generate(PROMPTS[(i + k) % len(PROMPTS)], sampling, engine_id=engine_id)
            except FencedEngineError:
                # A stream pinned to an engine that the activation fenced: its last rollout
                # completed before the fence, and the next one finds the engine out of the fleet.
                return
            completions.append(c)
            k += 1
            if done.is_set() or c.status != "completed":
                return

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(stream, i)
        with anyio.move_on_after(300):  # an engine worker sharing core 0 with others can be starved for a minute
            while sum(t.n_tokens >= min_tokens for t in fleet.tracks.values()) < n:
                await anyio.sleep(0.005)
        if sum(t.n_tokens >= min_tokens for t in fleet.tracks.values()) < n:
            raise AssertionError(f"load did not start: tracks {[(t.engine, t.n_tokens) for t in fleet.tracks.values()]}, "
                                 f"ended {[(c.engine_id, c.status, c.reason) for c in completions]}")
        try:
            result["value"] = await activate()
        finally:
            done.set()
    return completions, result["value"]


class FaultyEngine(Engine):
    """Fault injection around a real engine: `hooks[name]` (an async callable taking the inner
    engine and the call's arguments) runs instead of, or before, the real call."""

    def __init__(self, inner: Engine, **hooks):
        self.inner = inner
        self.engine_id = inner.engine_id
        self.hooks = hooks

    async def _hooked(self, name, *args, **kwargs):
        hook = self.hooks.get(name)
        if hook is not None:
            return await hook(self.inner, *args, **kwargs)
        return await getattr(self.inner, name)(*args, **kwargs)

    async def start(self):
        await self.inner.start()

    def generate(self, request_id, prompt_token_ids, sampling, cache_salt=None):
        return self.inner.generate(request_id, prompt_token_ids, sampling, cache_salt)

    async def abort(self, request_id):
        await self.inner.abort(request_id)

    async def pause(self, mode="keep", clear_cache=True):
        return await self._hooked("pause", mode, clear_cache)

    async def resume(self):
        return await self._hooked("resume")

    async def is_paused(self):
        return await self.inner.is_paused()

    async def healthy(self):
        return await self.inner.healthy()

    async def set_weight_version(self, version):
        return await self._hooked("set_weight_version", version)

    async def reset_prefix_cache(self):
        return await self.inner.reset_prefix_cache()

    async def collective_rpc(self, method, args=(), kwargs=None, timeout=None):
        hook = self.hooks.get(method)
        if hook is not None:
            return await hook(self.inner, method, args, kwargs, timeout)
        return await self.inner.collective_rpc(method, args=args, kwargs=kwargs, timeout=timeout)

    async def shutdown(self):
        await self.inner.shutdown()


def explain_mismatch(c, refs: References, record=None) -> str:
    """What a completion whose logprobs match no reference does match: each version whole, and
    each split of the prompt between two versions at a KV-cache block boundary (a prefix-cache
    hit computed under other weights). For a failure message: one line per hypothesis within
    1e-3 and the best few otherwise."""
    n_prompt, n = len(c.prompt_token_ids), len(c.prompt_token_ids) + len(c.token_ids) - 1
    tried: list[tuple[float, str]] = []
    for v in sorted(refs.models):
        tried.append((max_err(c.logprobs, refs.full(v, c.prompt_token_ids, c.token_ids)), f"all under v{v}"))
    versions = sorted(refs.models)[-3:]
    for cut in (16, 32, 64, 128):
        if cut >= n_prompt:
            continue
        for a in versions:
            for b in versions:
                if a != b:
                    feed = [a] * cut + [b] * (n - cut)
                    err = max_err(c.logprobs, fed_logprobs(refs.models, c.prompt_token_ids, c.token_ids, feed))
                    tried.append((err, f"prompt[:{cut}] under v{a}, the rest under v{b}"))
    tried.sort()
    lines = [f"{err:.2e}  {what}" for err, what in tried[:5]]
    return (f"{c.request_id} on {c.engine_id}: changes {c.change_points()}, dispatched v{c.dispatched_version} at "
            f"{c.dispatched_at}, first token {c.first_token_at}, finished {c.finished_at}, carried "
            f"{c.kv_carried_across_versions}; best matches:\n  " + "\n  ".join(lines)
            + (f"\nrecord: {record}" if record is not None else ""))


def attributable(completions) -> list:
    """The completed rollouts; every other one must be a pause-free rollout whose versions the
    fleet could not know (`errored(version_unknown)`, recorded without tokens), and those must
    stay the exception."""
    done = [c for c in completions if c.status == "completed"]
    for c in completions:
        if c.status != "completed":
            assert c.status == "errored" and c.reason == "version_unknown", (c.status, c.reason, c.message)
            assert c.token_ids == [] and c.logprobs == [] and c.change_points() == []
    assert len(done) > len(completions) // 2, [(c.status, c.reason) for c in completions]
    return done
