"""A `verifiers` environment as an agent task (issue #19, docs/agents.md):

    [task]
    entrypoint = "orchestrator.tasks.verifiers:make"
    args = {env = "my_env", difficulty = "easy"}    # env: an installed environment's id or module

`make` loads the environment (`verifiers.load_environment(env, **args)`: the module named by the
id, with `-` read as `_`, and its `load_environment(**args)`) and returns a task whose rows are
the environment's dataset (its train split, else its eval split) and whose `run(client, row)`
plays one rollout of it (single-turn, multi-turn or tool environments alike) against the run's
endpoint, then scores it with the environment's rubric: that score is the episode's reward.

Written for the classic verifiers API (0.1.x: `Environment.rollout(input, client, model,
sampling_args)`, `MultiTurnEnv`, `Rubric.score_rollout`), the one that runs in-process on an
`openai` client. verifiers 0.4 replaced it (`verifiers.v1`: harness programs in sandboxed
runtimes behind an interception proxy) and is refused here, by name: its environments run through
`orchestrator.tasks.verifiers04:make`, in a venv of their own.

Two things verifiers does that a run cannot have are held off: its `Environment` installs
process-wide SIGINT/SIGTERM handlers when constructed (the run owns those signals: they stop
it gracefully), so the environment is built with that step skipped; and a rollout that fails
(its model call refused, say) is an error of the episode, never a reward.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
from collections.abc import Sequence

from orchestrator.errors import ConfigError
from orchestrator.tasks.agent_endpoint import MODEL_NAME

FIELD = "task.args.env"


class VerifiersError(Exception):
    """A rollout of the verifiers environment failed (its own `state["error"]`)."""


def make(env: str, **env_args) -> VerifiersTask:
    """The task of verifiers environment `env`, loaded with `env_args`."""
    if not isinstance(env, str) or not env:
        raise ConfigError(FIELD, f"name a verifiers environment (its id or module), got {env!r}")
    vf = _import_verifiers()
    module = env.replace("-", "_").split("/")[-1]  # how verifiers finds an environment's module
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise ConfigError(FIELD, f"no verifiers environment {env!r}: no module {module!r} is installed")
    with _signals_kept():
        loaded = vf.load_environment(env, **env_args)
    return VerifiersTask(loaded, env)


class VerifiersTask:
    """Rows: the environment's dataset. `run(client, row)`: one scored rollout."""

    def __init__(self, env, env_id: str) -> None:
        self.env = env
        self.name = env_id
        self._check_rubric()
        self._rows = env.get_dataset() if env.dataset is not None or env.dataset_source else env.get_eval_dataset()
        # The environment's own sampling arguments go with every call: the endpoint refuses any
        # that differ from the run's (a record never claims settings that were not used).
        self.sampling_args = copy.deepcopy(dict(env.sampling_args or {}))

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, index: int) -> dict:
        if not 0 <= index < len(self._rows):
            raise IndexError(f"row {index} of {len(self._rows)}")
        return dict(self._rows[index])

    async def run(self, client, row: dict) -> float:
        state = await self.env.rollout(copy.deepcopy(row), client, MODEL_NAME, copy.deepcopy(self.sampling_args))
        if state.get("error") is not None:
            raise VerifiersError(f"the rollout of {self.name} failed: {_describe(state['error'])}")
        if state.get("prompt_too_long"):
            raise VerifiersError(f"the rollout of {self.name} ran out of context (the episode's token budget)")
        await self.env.rubric.score_rollout(state)
        reward = state.get("reward")
        if reward is None or not math.isfinite(float(reward)):
            raise VerifiersError(f"the rubric of {self.name} gave no finite reward ({reward!r})")
        return float(reward)

    def _check_rubric(self) -> None:
        """Each episode is scored on its own: a group-level reward function (one that compares
        the rollouts of a prompt) would be handed a group of one."""
        rubric = self.env.rubric
        funcs: Sequence = rubric._get_reward_funcs()
        group = [getattr(f, "__name__", repr(f)) for f in funcs if rubric._is_group_func(f)]
        if group:
            raise ConfigError(FIELD, f"{self.name}'s rubric has group-level reward functions ({', '.join(group)}): "
                                     "inflight scores each episode on its own")


def _import_verifiers():
    try:
        import verifiers as vf
    except ImportError:
        raise ConfigError(FIELD, "the verifiers package is not installed (pip install verifiers==0.1.10)") \
            from None
    if not hasattr(vf, "MultiTurnEnv") or not hasattr(vf, "load_environment"):
        version = getattr(vf, "__version__", "?")
        raise ConfigError(FIELD, f"verifiers {version} has no in-process environments (MultiTurnEnv, "
                                 "load_environment): this adapter runs the classic API (pip install verifiers==0.1.10)")
    return vf


@contextlib.contextmanager
def _signals_kept():
    """Construct environments without their SIGINT/SIGTERM handlers: verifiers installs them
    process-wide (taking a graceful stop from the run), and off the main thread it would fail."""
    from verifiers.envs import environment

    real = environment.signal
    environment.signal = _NoHandlers(real)
    try:
        yield
    finally:
        environment.signal = real


class _NoHandlers:
    """The `signal` module, less `signal.signal`."""

    def __init__(self, module) -> None:
        self._module = module

    def __getattr__(self, name: str):
        return getattr(self._module, name)

    def signal(self, signalnum, handler):
        return self._module.getsignal(signalnum)


def _describe(error: BaseException) -> str:
    """The error and its causes (verifiers wraps the client's error in a bare ModelError)."""
    parts, seen = [], set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        parts.append(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        error = error.__cause__ or error.__context__
    return " <- ".join(parts)[:1000]
