"""Benchmarks of the transports (`inflight bench transports`), kept apart from the code they measure."""
