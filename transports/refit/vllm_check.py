"""Does vLLM's own loader take what a refit sends? `vllm_accepts(hf_config, refit_info)` builds
vLLM's model class for the config's architecture (no engine, no KV cache, no weights read),
then feeds it every `(name, tensor of the refit info's shape and dtype)`, one name per
`load_weights` call, and reports

* `rejected`: names `load_weights` raised on (no such module or parameter, a shape a weight
  loader refused), with vLLM's message, and names of which not every value landed in a vLLM
  tensor: vLLM's tensor-parallel loaders narrow what they are given to the slice they expect,
  so a tensor too large along a sharded dim loads without an error (seen with Qwen3-Next's
  `in_proj_ba`); every target is set to NaN before each name and the values no longer NaN
  are counted;
* `ignored`: names it took without loading any tensor (a prefix it skips, a name it maps to
  nothing, an unexpected `.bias`), which a refit would send for nothing;
* `never_loaded`: vLLM parameters no name of the refit info loaded, which would keep stale
  values after a refit.

Built on the CPU by default (real, untouched-by-kernels parameters: `load_weights` runs before
any CPU repacking), which suits the tiny configs tests build; `device="meta"` builds any size
but cannot count landed values. vLLM is imported lazily. A process without vLLM distributed
state gets a one-rank gloo group for the construction, torn down afterwards, so an engine
started later in the same process sets up its own. The first check of an architecture on a
machine also pays vLLM's model inspection in a subprocess (cached under ~/.cache/vllm).
"""

from __future__ import annotations

import contextlib
import copy
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence

import msgspec
import torch

from transports.errors import TransportConfigError

#: transformers `model_type` -> the vLLM architecture a text-only checkpoint of it names.
ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "gemma4_text": "Gemma4ForCausalLM",
}


class VllmLoadReport(msgspec.Struct, frozen=True):
    architecture: str  # the vLLM model class that was built
    device: str  # where its parameters lived ("meta")
    accepted: tuple[str, ...]  # names that loaded at least one parameter
    rejected: dict[str, str]  # name -> vLLM's error
    ignored: tuple[str, ...]  # names taken without loading anything
    never_loaded: tuple[str, ...]  # vLLM parameters no name loaded

    @property
    def ok(self) -> bool:
        return not (self.rejected or self.ignored or self.never_loaded)

    def describe(self) -> str:
        parts = [f"{self.architecture} on {self.device}: {len(self.accepted)} names accepted"]
        parts += [f"rejected {name!r}: {why}" for name, why in sorted(self.rejected.items())]
        parts += [f"ignored {name!r}" for name in self.ignored]
        parts += [f"never loaded: vLLM parameter {name!r}" for name in self.never_loaded]
        return "; ".join(parts)


def architecture_of(hf_config) -> str:
    archs = list(getattr(hf_config, "architectures", None) or ())
    if archs:
        return archs[0]
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise TransportConfigError(f"model_type {model_type!r}: no vLLM architecture known "
                                   f"(known: {', '.join(sorted(ARCHITECTURES))})")
    return ARCHITECTURES[model_type]


def vllm_accepts(hf_config, refit_info: Mapping[str, tuple[Sequence[int], torch.dtype]], *,
                 device: str = "cpu", dtype: str = "float32") -> VllmLoadReport:
    """See the module docstring. `refit_info`: `{hf_name: (shape, dtype)}`, e.g.
    `RefitPlan.refit_info()` or a synchronizer's `prepare_refit_info()`. `device="meta"` builds
    without parameter memory (any size) but cannot count what landed, so a tensor too large
    along a dim vLLM narrows for tensor parallelism goes unnoticed there."""
    arch = architecture_of(hf_config)
    with tempfile.TemporaryDirectory(prefix="inflight-vllm-check-") as model_dir:
        config = copy.deepcopy(hf_config)
        config.architectures = [arch]
        config.save_pretrained(model_dir)
        vllm_config = _engine_config(model_dir, dtype)
        with _one_rank_group(vllm_config):
            model = _build(vllm_config, device)
            return _feed(model, arch, device, refit_info)


def _engine_config(model_dir: str, dtype: str):
    from vllm.engine.arg_utils import EngineArgs

    # No tokenizer, no weights read, no graphs: the config only sizes the model.
    args = EngineArgs(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
                      max_model_len=128, load_format="dummy", distributed_executor_backend="uni")
    return args.create_engine_config()


@contextlib.contextmanager
def _one_rank_group(vllm_config) -> Iterator[None]:
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    ours = not ps.model_parallel_is_initialized()
    with set_current_vllm_config(vllm_config):
        if ours:
            ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                            distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
            ps.ensure_model_parallel_initialized(1, 1)
        try:
            yield
        finally:
            if ours:
                ps.destroy_model_parallel()
                ps.destroy_distributed_environment()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(vllm_config, device: str) -> torch.nn.Module:
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_default_torch_dtype(vllm_config.model_config.dtype), torch.device(device):
        return initialize_model(vllm_config=vllm_config)


def _feed(model: torch.nn.Module, arch: str, device: str,
          refit_info: Mapping[str, tuple[Sequence[int], torch.dtype]]) -> VllmLoadReport:
    targets = _loadable(model)
    count = device != "meta"
    # vLLM shares some modules between model instances (rotary embeddings are cached by their
    # settings): every target gets its values back afterwards, so an engine built later in the
    # same process never sees the NaN fill.
    saved = {n: t.detach().clone() for n, t in targets.items()} if count else {}
    try:
        return _feed_each(model, arch, device, refit_info, targets, count)
    finally:
        with torch.no_grad():
            for n, t in saved.items():
                targets[n].data.copy_(t)


def _loadable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (Gemma 4's `layer_scalar` is one): what a name can
    land in. Non-persistent buffers (caches built from the config) are left alone."""
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = buf
    out.update(model.named_parameters())
    return out


def _feed_each(model: torch.nn.Module, arch: str, device: str,
               refit_info: Mapping[str, tuple[Sequence[int], torch.dtype]],
               targets: dict[str, torch.Tensor], count: bool) -> VllmLoadReport:
    accepted: list[str] = []
    rejected: dict[str, str] = {}
    ignored: list[str] = []
    loaded: set[str] = set()
    for name, (shape, dtype) in refit_info.items():
        tensor = torch.ones(tuple(shape), dtype=dtype)
        if count:  # every target NaN: what this name's load writes is then what is no longer NaN
            with torch.no_grad():
                for t in targets.values():
                    if t.is_floating_point():
                        t.data.fill_(float("nan"))
        try:
            got = model.load_weights([(name, tensor)])
        # vLLM's loaders raise these (unknown name, shape assertion, missing attribute), untyped.
        except (ValueError, KeyError, AssertionError, AttributeError, IndexError, RuntimeError, TypeError) as exc:
            rejected[name] = f"{type(exc).__name__}: {exc}"
            continue
        got = set(got or ())
        if not got:
            ignored.append(name)
            continue
        if count:
            # A tensor-parallel loader narrows what it is given to the slice it expects, so a
            # tensor too large along a sharded dim loads without complaint: count what landed.
            landed = sum(int((~torch.isnan(targets[n].data)).sum()) for n in got
                         if n in targets and targets[n].is_floating_point())
            if landed < tensor.numel():
                rejected[name] = (f"only {landed} of its {tensor.numel()} values landed in {sorted(got)}: "
                                  f"shape {tuple(shape)} is not what vLLM expects")
                continue
        accepted.append(name)
        loaded |= got
    params = [n for n, _ in model.named_parameters()]
    never = tuple(n for n in params if n not in loaded)
    return VllmLoadReport(arch, device, tuple(accepted), rejected, tuple(ignored), never)
