"""Off-policy replay: recompute recorded tokens' logprobs under any version (`inflight replay`).

Modules: `recompute` (weights from safetensors, batched recomputation, single-sequence
references), `versions` (where each version's weights are), `dataset` (reading the log),
`stats` (estimators, buckets), `analyze` (the analysis), `report` (plots, Markdown, HTML,
Parquet), `bench` (`inflight bench replay-analysis`). See docs/replay-analysis.md.
"""
