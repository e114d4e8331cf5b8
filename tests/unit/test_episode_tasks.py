"""How `[task]` builds a multi-turn task (orchestrator/tasks/episodes.py): an environment or an
agent, its rows, and every mistake refused at start naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config.run import EvalConfig, TaskConfig
from orchestrator.errors import ConfigError
from orchestrator.tasks import make_task

# models/tiny-rl of the checkout, built when missing (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("checkout_rl_model")
MODEL = str(Path(__file__).resolve().parents[2] / "models" / "tiny-rl")
DIALOGUE = "orchestrator.tasks.toy_env:digits_dialogue"


def test_an_environment_gives_episodic_rows_of_its_own():
    task = make_task(TaskConfig(entrypoint=DIALOGUE, args={"turns": 2}), MODEL)
    assert task.episodic and task.runner.env.max_turns == 2
    prompt = task.prompt_sync(3)
    assert prompt.row == {"index": 3} and prompt.token_ids == ()


def test_an_environment_without_rows_takes_the_dataset(tmp_path, monkeypatch):
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps({"a": i}) for i in range(3)) + "\n")
    (tmp_path / "envmod.py").write_text(
        "from orchestrator.tasks.env import Environment\n"
        "class E(Environment):\n"
        "    async def reset(self, row): return [{'role': 'user', 'content': str(row['a'])}]\n"
        "    async def step(self, episode): return [], 1.0, True\n"
        "def make(): return E()\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as missing:
        make_task(TaskConfig(entrypoint="envmod:make"), MODEL, search_path=[str(tmp_path)])
    assert missing.value.field == "task.dataset"
    task = make_task(TaskConfig(entrypoint="envmod:make", dataset="rows.jsonl", shuffle=False), MODEL,
                     search_path=[str(tmp_path)])
    assert task.rows == 3 and task.prompt_sync(1).row == {"a": 1}


@pytest.mark.parametrize("config, field", [
    (TaskConfig(entrypoint=DIALOGUE, rewards=[{"fn": "exact"}]), "task.rewards"),
    (TaskConfig(entrypoint=DIALOGUE, chat_template=False), "task.chat_template"),
    (TaskConfig(entrypoint=DIALOGUE, args={"max_episode_tokens": 0}), "task.entrypoint"),
    (TaskConfig(agent="orchestrator.tasks.toy_agent:digits_agent"), "task.dataset"),
    (TaskConfig(agent="orchestrator.tasks.toy_agent:nowhere", entrypoint="orchestrator.tasks.toy_agent:rows"),
     "task.agent"),
    (TaskConfig(agent="orchestrator.tasks.toy_agent:digits_agent", entrypoint="orchestrator.tasks.toy_agent:rows",
                rewards=[{"fn": "exact"}]), "task.rewards"),
])
def test_a_multi_turn_mistake_is_refused_naming_the_field(config, field):
    with pytest.raises(ConfigError) as refused:
        make_task(config.validate(), MODEL)
    assert refused.value.field == field


def test_a_malformed_agent_path_and_timeout_are_refused_by_the_config():
    with pytest.raises(ConfigError) as refused:
        TaskConfig(agent="no_colon").validate()
    assert refused.value.field == "task.agent"
    with pytest.raises(ConfigError) as refused:
        TaskConfig(agent="a:b", agent_timeout_s=0).validate()
    assert refused.value.field == "task.agent_timeout_s"


@pytest.mark.parametrize("text", ["truncation_reward = nan", "truncation_reward = -inf",
                                  "truncation_reward = \"zero\"", "truncation_reward = true"])
def test_a_truncation_reward_that_is_not_a_finite_number_is_refused_naming_it(tmp_path, text):
    from orchestrator.config.run import load_config

    (tmp_path / "bad.toml").write_text(f"[task]\n{text}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(tmp_path / "bad.toml")
    assert refused.value.field == "task.truncation_reward"


def test_the_truncation_reward_reaches_an_environments_and_an_agents_episodes(tmp_path):
    from orchestrator.config.run import load_config

    (tmp_path / "ok.toml").write_text("[task]\ntruncation_reward = -1\n")
    assert load_config(tmp_path / "ok.toml").task.truncation_reward == -1.0
    env = make_task(TaskConfig(entrypoint=DIALOGUE, truncation_reward=-0.5), MODEL)
    agent = make_task(TaskConfig(agent="orchestrator.tasks.toy_agent:digits_agent",
                                 entrypoint="orchestrator.tasks.toy_agent:rows", truncation_reward=-0.5), MODEL)
    assert env.runner.truncation_reward == agent.runner.truncation_reward == -0.5
    assert make_task(TaskConfig(entrypoint=DIALOGUE), MODEL).runner.truncation_reward == 0.0


def test_an_agent_task_serves_an_endpoint_of_its_own():
    task = make_task(TaskConfig(agent="orchestrator.tasks.toy_agent:digits_agent",
                                entrypoint="orchestrator.tasks.toy_agent:rows"), MODEL)
    assert task.episodic and task.agent_endpoint is not None and task.name == "digits_agent"
    assert {r.path for r in task.agent_endpoint.routes()} >= {"/v1/chat/completions", "/v1/completions"}
    from orchestrator.tasks.token_route import served_routes  # what the run mounts: the generate route too

    assert {r.path for r in served_routes(task.agent_endpoint)} >= {"/inference/v1/generate",
                                                                    "/e/{episode}/inference/v1/generate"}


def test_a_held_out_evaluation_of_a_multi_turn_task_is_refused():
    from orchestrator.run.eval import Evaluator

    task = make_task(TaskConfig(entrypoint=DIALOGUE), MODEL)
    with pytest.raises(ConfigError) as refused:
        Evaluator(task, None, EvalConfig(every_steps=1), None)
    assert refused.value.field == "eval"


def test_the_runs_runner_of_user_code_reaches_an_environments_and_an_agents_episodes():
    from orchestrator.tasks.user_code import UserCode

    user_code = UserCode(threads=100)  # what `inflight run` makes of scheduler.max_inflight = 100
    env = make_task(TaskConfig(entrypoint=DIALOGUE), MODEL, user_code=user_code)
    agent = make_task(TaskConfig(agent="orchestrator.tasks.toy_agent:digits_agent",
                                 entrypoint="orchestrator.tasks.toy_agent:rows"), MODEL, user_code=user_code)
    assert env.runner.user_code is user_code and agent.runner.user_code is user_code
    assert make_task(TaskConfig(entrypoint=DIALOGUE), MODEL).runner.user_code.threads == 256  # the default's
