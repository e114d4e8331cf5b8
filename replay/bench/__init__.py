"""Benchmarks of the replay log and its analysis (`inflight bench replay|replay-analysis`), kept apart
from the code they measure."""
