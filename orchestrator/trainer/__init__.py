"""The trainer: a separate process (`process.py`) that the orchestrator drives over a ZMQ link
(`link.py`), with the GRPO losses (`loss.py`), versioned publishing through the project's
synchronizer (`publish.py`) and atomic checkpoints (`checkpoint.py`).

Importing this package imports nothing heavy; `link` needs only msgspec, numpy and pyzmq.
"""
