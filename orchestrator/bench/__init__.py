"""Benchmarks of the orchestrator (`inflight bench activation|orchestrator`, the end-to-end transport rows),
kept apart from the code they measure."""
