"""Tasks: prompts and rewards (docs/tasks.md). `make_task(config, model_dir)` builds the configured one:

    [task] entrypoint = "pkg.mod:make"   the user's factory: a task object (row(), score()), a dataset,
                                         or a multi-turn environment (reset(), step(): tasks/episodes.py)
    [task] dataset = "data.jsonl"         rows from a file, scored by [task] rewards
    [task] name = "digits" | "length"     a built-in toy

`task.chat_template` (true: the model's; false: none; a path: that Jinja file) renders every prompt
and turn (`templates.py`); a template that raises on what the task sends stops the run at start,
named.
"""

from __future__ import annotations

from orchestrator.config.run import TaskConfig
from orchestrator.errors import ConfigError
from orchestrator.tasks.base import Prompt, Task, TaskExhausted
from orchestrator.tasks.toy import DigitsTask, LengthTask

TASKS: dict[str, type[Task]] = {"digits": DigitsTask, "length": LengthTask}


def make_task(config: TaskConfig, model_dir: str, *, search_path: list[str] | None = None,
              where: str = "task", tokenizer=None, scoring_only: bool = False, sampling=None,
              user_code=None) -> Task:
    """The configured task, with the tokenizer of the model the engines serve. Everything that
    can be checked (imports, the dataset, every row's prompt, the chat template, the rewards) is
    checked here, so a mistake stops the run before any engine starts. `scoring_only`: for a
    scoring worker, which gets each prompt's row with the completion: no dataset read, no row
    scanned. `sampling`: the run's `SamplingSettings` (its stop_token_ids end turns too).
    `user_code`: the run's runner of a multi-turn task's calls into user code
    (`tasks.user_code.UserCode`, its threads from scheduler.max_inflight; default: one of the
    task's own)."""
    from orchestrator.tasks.templates import engine_stop_ids, with_template

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer = with_template(tokenizer, config.chat_template, f"{where}.chat_template")
    stop_ids = engine_stop_ids(tokenizer, model_dir, sampling)
    if config.agent is not None:
        return _agent_task(config, tokenizer, where, search_path, scoring_only, stop_ids, user_code)
    if config.entrypoint is None and config.dataset is None:
        if config.name not in TASKS:
            raise ConfigError(f"{where}.name", f"unknown task {config.name!r}; choose one of {sorted(TASKS)}")
        if config.rewards:
            raise ConfigError(f"{where}.rewards", f"the built-in task {config.name!r} has its own reward; "
                                                  "rewards apply to a dataset or an entrypoint")
        if config.chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(f"{where}.chat_template", "the model's tokenizer has no chat template: set "
                                                        "chat_template = false to tokenize prompts as they are")
        toy = TASKS[config.name](tokenizer, config)
        toy.prompt_sync(0)  # its prompts are drawn while the run goes: one rendered now, at start
        return toy
    from orchestrator.tasks.rows import RowTask

    rewards = _rewards(config, where, search_path)
    if config.entrypoint is not None:
        from orchestrator.tasks.dataset import rows_of
        from orchestrator.tasks.entrypoint import call_factory, load_callable

        factory = load_callable(config.entrypoint, f"{where}.entrypoint", search_path)
        # A factory may name the tokenizer, the engines' model and the run's search path to get them
        # (orchestrator.tasks.verifiers04:make hands the last two to its driver process).
        made = call_factory(factory, dict(config.args), where, tokenizer=tokenizer, model_dir=model_dir,
                            search_path=list(search_path or []))
        from orchestrator.tasks.episodes import environment_task, is_environment

        if is_environment(made):
            from orchestrator.tasks.dataset import load_rows

            return environment_task(made, tokenizer, config, where=where, scan=not scoring_only, load_rows=load_rows,
                                    stop_ids=stop_ids, user_code=user_code)
        if callable(getattr(made, "run", None)) and callable(getattr(made, "row", None)):
            from orchestrator.tasks.episodes import agent_task  # e.g. orchestrator.tasks.verifiers:make

            return agent_task(made.run, tokenizer, config, where=where, scan=not scoring_only, source=made,
                              stop_ids=stop_ids, user_code=user_code)
        if callable(getattr(made, "row", None)):
            name = config.id or getattr(made, "name", None) or config.task_id
            return RowTask(tokenizer, config, name=str(name), source=made, rewards=rewards, where=where,
                           scan=not scoring_only)
        rows = [] if scoring_only else rows_of(made, f"{where}.entrypoint")
        return RowTask(tokenizer, config, name=config.task_id, rows=rows, rewards=rewards, where=where,
                       scan=not scoring_only)
    from orchestrator.tasks.dataset import load_rows

    rows = [] if scoring_only else load_rows(config.dataset, f"{where}.dataset")
    return RowTask(tokenizer, config, name=config.task_id, rows=rows, rewards=rewards, where=where,
                   scan=not scoring_only)


def _agent_task(config: TaskConfig, tokenizer, where: str, search_path: list[str] | None, scoring_only: bool,
                stop_ids, user_code=None):
    """`task.agent`: the agent function, rows from `task.entrypoint` (a task object with row(),
    or a dataset) or `task.dataset`."""
    from orchestrator.tasks.dataset import load_rows, rows_of
    from orchestrator.tasks.entrypoint import call_factory, load_callable
    from orchestrator.tasks.episodes import agent_task

    run_fn = load_callable(config.agent, f"{where}.agent", search_path)
    scan = not scoring_only
    if config.entrypoint is not None:
        factory = load_callable(config.entrypoint, f"{where}.entrypoint", search_path)
        made = call_factory(factory, dict(config.args), where, tokenizer=tokenizer)
        if callable(getattr(made, "row", None)):
            return agent_task(run_fn, tokenizer, config, where=where, scan=scan, source=made, stop_ids=stop_ids, user_code=user_code)
        rows = rows_of(made, f"{where}.entrypoint") if scan else []
        return agent_task(run_fn, tokenizer, config, where=where, scan=scan, rows=rows, stop_ids=stop_ids, user_code=user_code)
    if config.dataset is None:
        raise ConfigError(f"{where}.dataset", "an agent needs rows (each episode's run(client, row) gets one): "
                                              "give task.dataset or task.entrypoint")
    rows = load_rows(config.dataset, f"{where}.dataset") if scan else []
    return agent_task(run_fn, tokenizer, config, where=where, scan=scan, rows=rows, stop_ids=stop_ids, user_code=user_code)


def _rewards(config: TaskConfig, where: str, search_path: list[str] | None):
    if not config.rewards:
        return None
    from orchestrator.tasks.rewards import build_rewards

    return build_rewards([dict(spec) for spec in config.rewards], answer_field=config.answer_field,
                         where=f"{where}.rewards", search_path=search_path)


__all__ = ["TASKS", "DigitsTask", "LengthTask", "Prompt", "Task", "TaskExhausted", "make_task"]
