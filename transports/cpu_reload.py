"""Worker side: two vLLM 0.32 CPU defects that make a weight update serve wrong outputs, and
their repair. Imports vLLM lazily; runs inside an engine worker, after vLLM's layerwise reload
(this project's `vllm_backend` and the swap path's `shadow.reload_into` / `BucketwiseReload`; vLLM's own `model_runner.reload_weights` has the same defects).

1. **MoE experts are not repacked.** On the CPU, unquantized fused experts run a grouped GEMM
   over weights that `CPUUnquantizedExperts.process_weights_after_loading` prepacks at start-up.
   On a weight update (`moe_kernel` already built) `UnquantizedFusedMoEMethod._setup_kernel`
   copies the new, unpacked weights into place and skips that prepack, so the kernel reads
   unpacked weights. Measured on a tiny Qwen3-MoE (fp32): reloading the very weights the engine
   started with moved its logprobs by 0.11 against a transformers forward (4.8e-7 before); the
   experts' `w13_weight` then equalled the unpacked checkpoint tensor.
2. **A tied LM head keeps its old GEMM handle.** With tied embeddings the `ParallelLMHead`
   shares the embedding's `weight`; on the CPU its `cpu_linear` is a oneDNN handle holding its
   own packed copy. A reload rebuilds the embedding's handle but not the head's, which keeps
   computing logits with the old embedding. Measured on a tiny Gemma 4: after reloading
   `embed_tokens.weight` the head's output was off by 0.59 from `x @ W.T` (3.6e-7 before).

Repairs: re-run the experts' own `process_weights_after_loading` on the layers the reload wrote
(packing twice would scramble a layer the reload left alone), and rebuild each tied head's
handle from its (shared, updated) weight. With both, a refit matches a transformers forward
within 1e-3 again (tests/unit/test_refit_families.py). Usage:

    initialize_layerwise_reload(model)
    model.load_weights(weights)
    written = cpu_moe_layers_written(model)    # before finalize, which resets the counts
    finalize_layerwise_reload(model, model_config)
    repair_cpu_reload(model, written)
"""

from __future__ import annotations

import torch


def _cpu_experts(module: torch.nn.Module):
    """The CPU unquantized experts kernel of a fused-MoE layer, or None."""
    method = getattr(module, "quant_method", None)
    kernel = getattr(method, "moe_kernel", None)
    experts = getattr(kernel, "fused_experts", None)
    if experts is None:
        return None
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
        CPUUnquantizedExperts,
    )

    return experts if isinstance(experts, CPUUnquantizedExperts) else None


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def cpu_moe_layers_written(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Fused-MoE layers on CPU experts that the current layerwise reload wrote weights into.
    Call between `load_weights` and `finalize_layerwise_reload`. Empty off the CPU."""
    if not _on_cpu():
        return []
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    def written(layer: torch.nn.Module) -> bool:
        info = get_layerwise_info(layer)
        # Fully loaded layers were processed during `load_weights` and their info reset (no
        # longer loadable); partly loaded ones are processed by finalize; a layer with nothing
        # loaded gets its packed tensors back.
        return not info.can_load() or (info.load_numel or 0) > 0

    return [m for m in model.modules() if _cpu_experts(m) is not None and written(m)]


def repair_cpu_reload(model: torch.nn.Module, moe_written: list[torch.nn.Module]) -> None:
    """Call after `finalize_layerwise_reload`; see the module docstring. No-op off the CPU."""
    if not _on_cpu():
        return
    for layer in moe_written:
        _cpu_experts(layer).process_weights_after_loading(layer)
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        VocabParallelEmbedding,
    )

    embeddings = {id(m.weight) for m in model.modules()
                  if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    for head in model.modules():
        if isinstance(head, ParallelLMHead) and id(head.weight) in embeddings and hasattr(head, "cpu_linear"):
            head.quant_method.process_weights_after_loading(head)  # rebuilds the GEMM handle only
