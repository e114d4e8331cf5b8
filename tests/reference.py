"""Reference computations for tests: a plain transformers forward of the same weights.

The implementation is the library's (`replay.analysis.recompute`, what `inflight replay`
batches over a whole log); these names are kept for the tests that use them.
"""

from __future__ import annotations

from collections.abc import Sequence

from replay.analysis.recompute import cached_model as load_reference_model
from replay.analysis.recompute import sequence_logprobs

__all__ = ["load_reference_model", "reference_logprobs"]


def reference_logprobs(model_or_dir, prompt_ids: Sequence[int], completion_ids: Sequence[int]) -> list[float]:
    """log p(completion_ids[i] | prompt, completion[:i]) under a transformers forward, fp32."""
    return sequence_logprobs(model_or_dir, prompt_ids, completion_ids)
