"""The error tree of inflight-rl, in one place.

    InflightError                     base of every error the `inflight` command reports as one line
    ├── ConfigError(field, reason)    bad configuration or command-line value; names the field
    ├── ModelError(path, reason)      a model directory that is missing, empty or unreadable
    └── EngineError                   anything an inference engine did wrong
        ├── EngineGenerateError       one request failed; the engine still serves (recoverable)
        ├── EngineTimeoutError        a remote call passed its deadline; the engine may be alive
        ├── EngineDeadError           the engine is gone (process exited, socket refused); fatal
        │                             for that engine, which reports unhealthy from then on
        └── FencedEngineError         the engine was fenced out of the fleet by a failed
                                      activation step; it takes no new requests until it
                                      re-synced to the live version (`Fleet.rejoin`)
    ClusterError (InflightError)      the cluster cannot place what the run asks for (`[cluster]`):
                                      names what was asked and what the cluster offers
    UserCodeTimeout(what, timeout_s)  a call into the user's code (a tool, an environment's step,
      (InflightError, TimeoutError)   a score, an agent) ran past its timeout; names the call
                                      (`tasks/user_code.py`); it ends that episode, not the run
    ActivationError (InflightError)   an activation could not run at all (no engine serves);
                                      a failed activation itself is not an exception: it is
                                      recorded (`activation.Record`, outcome rolled_back,
                                      engine_fenced or failed) and the old version keeps serving

`replay` and `transports` never import `orchestrator`, so they keep their own small trees
(`replay.errors.ReplayError`, `transports.base.TransportError`); the CLI treats those as
`InflightError`s too.
"""

from __future__ import annotations


class InflightError(Exception):
    """Base of every expected, user-facing failure."""


class ConfigError(InflightError, ValueError):
    def __init__(self, field: str, reason: str) -> None:
        self.field = field
        self.reason = reason
        super().__init__(f"{field}: {reason}")


class ModelError(InflightError):
    def __init__(self, path: object, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"model {self.path}: {reason}")


class EngineError(InflightError):
    def __init__(self, engine_id: str, message: str) -> None:
        self.engine_id = engine_id
        super().__init__(f"engine {engine_id}: {message}")


class EngineGenerateError(EngineError):
    """A single request failed; other requests and the engine are unaffected."""


class EngineTimeoutError(EngineError):
    """A call to the engine did not answer within its timeout."""


class EngineDeadError(EngineError):
    """The engine process is gone; every in-flight and future call fails with this."""


class FencedEngineError(EngineError):
    """The engine was fenced out of the fleet; it serves again only after re-syncing."""


class ActivationError(InflightError):
    """An activation could not be attempted (e.g. every engine is fenced)."""


class ClusterError(InflightError):
    """The cluster cannot place what the run asks for; names what was asked and what is offered."""


class UserCodeTimeout(InflightError, TimeoutError):
    """A call into the user's code ran past its timeout; `what` names the call ("tool 'add'")."""

    def __init__(self, what: str, timeout_s: float, where: str | None = None) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.where = where  # where its thread was when the time ran out (None: not known)
        at = f"; it was at {where}" if where else ""
        super().__init__(f"{what} ran past its timeout of {timeout_s:g} s{at}")
