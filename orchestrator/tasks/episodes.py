"""Multi-turn tasks (issue #19, docs/multi-turn.md): each rollout is an episode.

`[task] entrypoint` names a factory that returns an `Environment` (`orchestrator.tasks.env`:
async `reset(row)` and `step(episode)`), or `[task] agent` names a user's `async def run(client,
row) -> reward` that talks to the run's OpenAI-compatible endpoint (`orchestrator.tasks.agent`).
Either way the task is an `EpisodeTask`: rows as any row task draws them (the environment's own
`row(index)` and optional `__len__`, or `task.dataset`), and `run_episode(prompt, sample, ...)`
in place of a score: the reward is the episode's.

An environment's code runs off the run's event loop, through the run's user-code runner
(`user_code.py`: an async `reset`/`step` on the user-code loop, a plain `def` in a worker thread),
every `reset` and `step` bounded by its `step_timeout_s`: a step past it is cancelled there (a
thread is abandoned) and its episode ends (`environment_timeout`, naming the call); the run goes
on. An async environment that declares `on_loop = True` (it never blocks) runs on the run's loop
instead, bounded the same way.

The chat template is checked at start, before any engine starts, with the roles the task sends
(a tool message only for an environment with tools): one that is not prefix-preserving, or that
raises on what the task sends, is refused (`turns.TemplateError`, naming `task.chat_template`).
"""

from __future__ import annotations

from collections.abc import Callable

from orchestrator.config.run import TaskConfig
from orchestrator.errors import ConfigError
from orchestrator.tasks.base import Prompt
from orchestrator.tasks.env import Environment, Episode, Sampler, ToolEnvironment, run_episode
from orchestrator.tasks.rows import RowTask
from orchestrator.tasks.templates import template_source
from orchestrator.tasks.turns import TurnRenderer
from orchestrator.tasks.user_code import UserCode, is_async


def is_environment(made) -> bool:
    """Whether a factory's product is a multi-turn environment (reset and step, duck-typed)."""
    return isinstance(made, Environment) or (callable(getattr(made, "reset", None))
                                             and callable(getattr(made, "step", None)))


class EnvironmentEpisodes:
    """Runs episodes of one environment, its code through `user_code` (the run's runner)."""

    def __init__(self, env, renderer: TurnRenderer, *, where: str = "task", user_code: UserCode | None = None,
                 truncation_reward: float = 0.0) -> None:
        self.env = env
        self.renderer = renderer
        self.user_code = user_code or UserCode()
        self.truncation_reward = truncation_reward  # task.truncation_reward: a cut episode's, by default
        for name, default in (("max_turns", 4), ("max_episode_tokens", 1024), ("step_timeout_s", 30.0)):
            value = getattr(env, name, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{where}.entrypoint", f"the environment's {name} must be a positive number, "
                                                         f"got {value!r}")

    async def run_episode(self, row: dict, sample: Sampler, max_tokens_per_turn: int,
                          started: Callable[[Episode], None] | None = None, max_len: int | None = None) -> Episode:
        return await run_episode(self.env, self.renderer, sample, row, max_tokens_per_turn,
                                 call=self._call, started=started, max_len=max_len,
                                 truncation_reward=self.truncation_reward)

    async def _call(self, fn, *args):
        """An environment call through the runner (on the run's loop for an async environment
        that declares `on_loop = True`); either way cancelled past step_timeout_s."""
        timeout_s = getattr(self.env, "step_timeout_s", 30.0)
        here = bool(getattr(self.env, "on_loop", False)) and is_async(fn)
        return await self.user_code.call(fn, *args, timeout_s=timeout_s, here=here,
                                         what=f"the environment's {getattr(fn, '__name__', 'call')}")

    def close(self) -> None:
        self.user_code.close()


class EpisodeTask(RowTask):
    """Rows from the environment (row(index), optional __len__) or from `task.dataset`; each
    rollout an episode of `runner` (EnvironmentEpisodes or agent.AgentEpisodes)."""

    episodic = True

    def __init__(self, tokenizer, config: TaskConfig, *, name: str, runner, renderer: TurnRenderer,
                 rows: list[dict] | None = None, source=None, where: str = "task", scan: bool = True,
                 agent_endpoint=None) -> None:
        self.runner = runner
        self.renderer = renderer
        # An agent task's endpoint: `inflight run` serves its routes and sets its sampling check
        # and `base_url` (the run's HTTP address) before the first episode.
        self.agent_endpoint = agent_endpoint
        self.base_url: str | None = None
        super().__init__(tokenizer, config, name=name, rows=rows, source=source, rewards=None, where=where,
                         scan=scan)

    def _check_scoring(self) -> None:
        """The episode's reward scores it; `task.rewards` would be a second, unused score, and the
        single-turn settings below would do nothing (issue #30: a knob takes effect or is refused)."""
        if self.config.rewards:
            raise ConfigError(f"{self.where}.rewards", "a multi-turn task's reward comes from its environment "
                                                       "(step) or agent (run); remove rewards")
        if self.config.max_prompt_tokens is not None:
            raise ConfigError(f"{self.where}.max_prompt_tokens",
                              "an episode's first prompt is rendered by its reset (or the agent's first call), not "
                              "from a row: bound the episode with the environment's max_episode_tokens instead")
        defaults = TaskConfig()
        for name, instead in (("score_timeout_s", "the environment's step_timeout_s, or task.agent_timeout_s"),
                              ("score_workers", "scheduler.max_inflight (one runner thread per episode)"),
                              ("score_pool", "scheduler.max_inflight (one runner thread per episode)")):
            if getattr(self.config, name) != getattr(defaults, name):
                raise ConfigError(f"{self.where}.{name}", f"single-turn scoring only: a multi-turn episode is scored "
                                                          f"by its environment or agent (bounded by {instead})")

    def _encode_row(self, row: dict, number: int) -> tuple[int, ...]:
        return ()  # the first prompt is what the episode's reset (or the agent's first call) renders

    def _check_columns(self, row: dict, number: int, needed: list[str]) -> None:
        return None

    def _prompt_text(self, row: dict) -> str:
        return ""

    async def run_episode(self, prompt: Prompt, sample: Sampler, max_tokens_per_turn: int,
                          started: Callable[[Episode], None] | None = None, max_len: int | None = None) -> Episode:
        """One episode of `prompt`'s row; `max_len`: the engines' context length (an episode
        never grows past it)."""
        row = dict(prompt.row or {})
        return await self.runner.run_episode(row, sample, max_tokens_per_turn, started=started, max_len=max_len)

    def close(self) -> None:
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def score_sync(self, prompt, completion_token_ids):
        raise TypeError("a multi-turn task is scored by its episodes (run_episode), not score()")


def environment_task(made, tokenizer, config: TaskConfig, *, where: str, scan: bool, load_rows,
                     stop_ids=None, user_code: UserCode | None = None) -> EpisodeTask:
    """The EpisodeTask of an environment a factory returned; `load_rows(path, field)` reads
    `task.dataset` when the environment has no rows of its own; `stop_ids`: every token id the
    engine ends a turn on (`templates.engine_stop_ids`); `user_code`: the run's runner."""
    sends, may_send = environment_roles(made)
    renderer = checked_renderer(tokenizer, config, where, stop_ids=stop_ids, sends=sends, may_send=may_send)
    runner = EnvironmentEpisodes(made, renderer, where=where, user_code=user_code,
                                 truncation_reward=config.truncation_reward)
    name = config.id or getattr(made, "name", None) or config.task_id
    if callable(getattr(made, "row", None)):
        return EpisodeTask(tokenizer, config, name=str(name), runner=runner, renderer=renderer, source=made,
                           where=where, scan=scan)
    if config.dataset is None:
        raise ConfigError(f"{where}.dataset", "the environment has no row(index): give task.dataset (the rows "
                                              "each episode's reset(row) gets)")
    rows = load_rows(config.dataset, f"{where}.dataset") if scan else []
    return EpisodeTask(tokenizer, config, name=str(name), runner=runner, renderer=renderer, rows=rows,
                       where=where, scan=scan)


def environment_roles(env) -> tuple[frozenset[str], frozenset[str]]:
    """(the roles an environment sends, those it may send) besides user and assistant: a tool
    message only when it has tools; a system message from a ToolEnvironment (its reset writes
    one), maybe from any other (a template without a system role serves an environment that
    never sends one)."""
    sends = {"tool"} if getattr(env, "tools", None) else set()
    if isinstance(env, ToolEnvironment):
        sends.add("system")
    return frozenset(sends), frozenset({"system"} - sends)


def checked_renderer(tokenizer, config: TaskConfig, where: str, *, stop_ids=None, sends=(),
                     may_send=("system", "tool")) -> TurnRenderer:
    """The episode's renderer, its template checked now, at start: prefix-preserving for the
    roles the task `sends` (and those it `may_send`, where the template renders them)."""
    if not config.chat_template:
        raise ConfigError(f"{where}.chat_template", "a multi-turn task renders its turns with the chat template: "
                                                    "chat_template = false cannot be used with it")
    renderer = TurnRenderer(tokenizer, field=f"{where}.chat_template", source=template_source(config.chat_template),
                            stop_ids=stop_ids)
    renderer.check_prefix_preserving(sends, may_send)
    return renderer


def agent_task(run_fn, tokenizer, config: TaskConfig, *, where: str, scan: bool, rows: list[dict] | None = None,
               source=None, stop_ids=None, user_code: UserCode | None = None) -> EpisodeTask:
    """The EpisodeTask of an agent `run(client, row)` (docs/agents.md): its endpoint is built
    here; `inflight run` serves it (orchestrator/run/run.py). An agent's messages are its own:
    system and tool messages are probed where the template renders them. `user_code`: the run's
    runner (its threads, one per episode in flight)."""
    from orchestrator.tasks.agent import AgentEpisodes
    from orchestrator.tasks.agent_endpoint import AgentEndpoint
    from transports.http_common import new_token

    if config.rewards:
        raise ConfigError(f"{where}.rewards", "an agent's reward is what its run(client, row) returns; remove rewards")
    renderer = checked_renderer(tokenizer, config, where, stop_ids=stop_ids)
    endpoint = AgentEndpoint(renderer, token=new_token())
    holder: list[EpisodeTask] = []

    def base_url() -> str:
        url = holder[0].base_url if holder else None
        if url is None:
            raise RuntimeError("the agent endpoint is not served yet")
        return url

    runner = AgentEpisodes(run_fn, endpoint, base_url, timeout_s=config.agent_timeout_s, user_code=user_code,
                           truncation_reward=config.truncation_reward)
    name = config.id or getattr(source, "name", None) or config.task_id
    task = EpisodeTask(tokenizer, config, name=str(name), runner=runner, renderer=renderer, rows=rows,
                       source=source, where=where, scan=scan, agent_endpoint=endpoint)
    holder.append(task)
    return task
