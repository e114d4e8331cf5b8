"""A run that cannot progress stops, naming why (issue 30, item 1): `inflight run` with a reward of the
user's that raises on every rollout, a real engine, a real trainer. Before, it admitted new groups
forever (tried: 420 s, no step, no exit, no line saying why)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.helpers import attach_to

pytestmark = [pytest.mark.engine, pytest.mark.slow]
STALL_S = 5


@pytest.mark.timeout(600)
def test_a_reward_that_always_raises_exits_2_within_all_errored_s_naming_the_function(tmp_path, rl_model, run_server):
    (tmp_path / "my_rewards.py").write_text(
        "def never(completion, **row):\n    raise ValueError('the grader is down')\n")
    (tmp_path / "train.jsonl").write_text("".join('{"prompt": "count to %d", "answer": "%d"}\n' % (i, i)
                                                  for i in range(64)))
    config = tmp_path / "run.toml"
    config.write_text(f"""
[engine]
model = "{rl_model}"
{attach_to(run_server)}
[task]
dataset = "{tmp_path / 'train.jsonl'}"
rewards = [{{ fn = "my_rewards:never" }}]
[run]
progress = "plain"
all_errored_s = {STALL_S}
[http]
enabled = false
""")
    error = stopped_naming_why(tmp_path, config)
    # stall_s is its default, 600 s: the stop came from a batch's worth of errors (scheduler.batch_size,
    # 64, fewer than run.error_window's 256) and all_errored_s
    assert "(run.all_errored_s = 5): the last 64 rollouts all errored: errored(reward_error) 64" in error, error
    assert "errored(reward_error)" in error and "reward 'never'" in error, error
    assert "the grader is down" in error and "orchestrator.jsonl" in error
    first = (tmp_path / "run" / "orchestrator.jsonl").read_text()
    assert '"run.startup"' in first and '"run.no_progress"' in first


def stopped_naming_why(tmp_path, config) -> str:
    """`inflight run` of `config` in `tmp_path`: exit 2 with one error line (returned) and no
    traceback, within start-up + stall_s + 60 s (no wall clock asserted beyond that bound)."""
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", "run", str(config), "--run-dir",
                          str(tmp_path / "run"), "--max-steps", "5"], capture_output=True, text=True, timeout=500,
                         cwd=tmp_path)
    took = time.monotonic() - started
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("inflight: error:")]
    assert len(errors) == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert took < 300 + STALL_S + 60
    return errors[0]


FAULTY_ENVS = '''
from orchestrator.tasks.env import Environment, ToolEnvironment


class ResetRaises(Environment):
    max_episode_tokens = 256

    def row(self, index):
        return {"index": index}

    async def reset(self, row):
        raise RuntimeError("the sandbox is down")

    async def step(self, episode):
        return [], 1.0, True


def total(*values: int) -> int:
    """Add numbers (a *args signature has no JSON schema)."""
    return sum(values)


class UndescribableTool(ToolEnvironment):
    tools = (total,)
    max_episode_tokens = 256

    def row(self, index):
        return {"index": index}

    def prompt(self, row):
        return "Add 1 and 2."

    def score(self, episode, row):
        return 1.0


def reset_raises(tokenizer=None):
    return ResetRaises()


def undescribable_tool(tokenizer=None):
    return UndescribableTool()
'''


@pytest.mark.timeout(600)
@pytest.mark.parametrize("factory, named", [("reset_raises", "the sandbox is down"),
                                            ("undescribable_tool", "cannot be described")])
def test_an_environment_that_fails_every_episode_exits_2_within_stall_s_naming_why(tmp_path, rl_model, run_server,
                                                                                   factory, named):
    """The issue's other two: an environment whose reset raises, a tool whose signature cannot be
    described (its schema fails at every episode's reset)."""
    (tmp_path / "faulty_envs.py").write_text(FAULTY_ENVS)
    config = tmp_path / "run.toml"
    config.write_text(f"""
[engine]
model = "{rl_model}"
{attach_to(run_server)}
[task]
entrypoint = "faulty_envs:{factory}"
[run]
progress = "plain"
stall_s = {STALL_S}
[http]
enabled = false
""")
    error = stopped_naming_why(tmp_path, config)
    assert "errored(environment_error)" in error and named in error, error
