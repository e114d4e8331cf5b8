"""`[fleet]`: engines that come and go while the run goes on (docs/fleet.md)."""

from __future__ import annotations

import msgspec

from orchestrator.errors import ConfigError


class FleetConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    # A leaving engine (`inflight fleet drain`, SIGTERM to its server) finishes its rollouts for
    # at most this long; then the rest are aborted (each recorded, and sampled again elsewhere).
    # Servers the run starts get it as vLLM's --shutdown-timeout, so a SIGTERM drains them too.
    drain_s: float = 120.0
    # A lost engine (died, killed, its host gone) is replaced by a new one of the same settings
    # that the run starts (engines the run started itself: local servers, in-process engines,
    # Ray-placed servers where the cluster has room); an engine attached by URL is not.
    replace: bool = False
    # Below this many serving engines no new group is admitted (rollouts already admitted go on);
    # /healthz and the display say why. The run stops (exit 2) after `min_engines_wait_s` below it.
    min_engines: int = 1
    min_engines_wait_s: float = 600.0
    # How often each server engine is asked whether it is leaving (a SIGTERM) or, fenced,
    # answers again.
    probe_s: float = 5.0

    def validate(self) -> FleetConfig:
        for name in ("drain_s", "min_engines_wait_s", "probe_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"fleet.{name}", f"must be > 0, got {getattr(self, name)}")
        if self.min_engines < 0:
            raise ConfigError("fleet.min_engines", f"must be >= 0, got {self.min_engines}")
        return self
