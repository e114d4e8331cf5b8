"""Sampling settings as configuration. The type is the replay record's own (one concept, one type):
what a rollout record says was used is exactly what the engine was given."""

from __future__ import annotations

from orchestrator.errors import ConfigError
from replay.errors import InvalidRecordError
from replay.records import SamplingSettings


def check_sampling(sampling: SamplingSettings) -> SamplingSettings:
    """Validate sampling settings as configuration: a bad value is a `ConfigError` naming
    `sampling.<field>`."""
    try:
        return sampling.validate()
    except InvalidRecordError as exc:
        raise ConfigError(exc.field if exc.field.startswith("sampling.") else f"sampling.{exc.field}",
                          exc.reason) from None
