"""Multi-turn episodes through `inflight run` (issue #19), real vLLM engine, real trainer process.

- `examples/multi-turn.toml` (3-turn digits dialogue on tiny-rl as it is): the reward rises; each
  episode's tokens are exactly turn 1's rendered prompt, then per turn the sampled tokens and the
  chat template's delta for the environment's message (checked here token by token, and the run
  itself errors an episode whose engine ran another prompt: none did); environment tokens have
  no logprob; activations land inside episodes and the record's change points say so;
  `inflight replay --verify-spans` passes over every sampled token; the trainer consumes them.
- A tool environment (a calculator on a tiny model tuned for seconds to call its tool): tool
  output recorded as environment tokens, a call that does not parse recorded `malformed_tool_call`.
- A chat template that is not prefix-preserving stops the run at start, naming the field.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from replay.log import read_records
from replay.records import ConsumptionRecord, RolloutRecord
from tests.helpers import attach_to

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.usefixtures("checkout_rl_model")]  # ROOT/models/tiny-rl
INFLIGHT = [sys.executable, "-m", "orchestrator.commands.cli"]
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "multi-turn.toml"
STEPS = 20  # of the example's 60: the reward passes 0.5 by about step 19 (seed 0)


def inflight(*args: str, timeout: float = 800) -> subprocess.CompletedProcess:
    return subprocess.run(INFLIGHT + list(args), capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def rollouts(run_dir: Path) -> list[RolloutRecord]:
    return [r for r in read_records(run_dir) if isinstance(r, RolloutRecord)]


@pytest.fixture(scope="module")
def dialogue_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multi-turn")
    config = root / "multi-turn.toml"
    config.write_text(EXAMPLE.read_text() + '\nprogress = "plain"\n')  # appended to [run], its last table
    run_dir = root / "run"
    done = inflight("run", str(config), "--run-dir", str(run_dir), "--max-steps", str(STEPS))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def test_the_dialogue_learns_and_each_episode_is_its_tokens_turn_by_turn(dialogue_run):
    from transformers import AutoTokenizer

    from orchestrator.tasks.env import _reply_text
    from orchestrator.tasks.turns import TurnRenderer

    stats = json.loads(inflight("stats", str(dialogue_run), "--json").stdout)
    rewards = [s["reward_mean"] for s in stats["per_step"]]
    assert len(rewards) == STEPS
    assert np.mean(rewards[-3:]) >= max(0.3, np.mean(rewards[:3]) + 0.25), rewards
    assert stats["turns"] == {"mean": 3.0, "max": 3}
    assert 0.2 < stats["environment_token_share"] < 0.8
    renderer = TurnRenderer(AutoTokenizer.from_pretrained(ROOT / "models" / "tiny-rl"))
    first = renderer.first_prompt([{"role": "user", "content": "Write digits."}])
    completed = [r for r in rollouts(dialogue_run) if r.status_name == "completed"]
    assert completed and not stats["errored_by_kind"]  # no prompt_mismatch, no environment error
    for r in completed:
        assert r.prompt_tokens().tolist() == first
        assert (r.turns, r.episode_end) == (3, "done")
        tokens, logprobs, spans = r.completion_tokens().tolist(), r.logprobs(), r.environment_ranges()
        assert np.isnan(logprobs[~r.sampled_mask()]).all() and np.isfinite(logprobs[r.sampled_mask()]).all()
        history = [{"role": "user", "content": "Write digits."}]
        turn_start = 0
        for start, end in spans:  # each environment span is the template's delta after that turn
            sampled = tokens[turn_start:start]
            delta = renderer.delta(history, sampled, [{"role": "user", "content": "More digits."}])
            assert tokens[start:end] == delta, f"rollout {r.rollout_id}: the environment's tokens at {start}"
            history += [{"role": "assistant", "content": _reply_text(renderer, sampled)},
                        {"role": "user", "content": "More digits."}]
            turn_start = end


def test_activations_land_inside_episodes_and_every_sampled_token_verifies(dialogue_run):
    inside = []
    for r in rollouts(dialogue_run):
        spans = r.environment_ranges()
        if r.status_name == "completed" and spans:
            inside += [start for start, _v in r.change_points()[1:] if start > spans[0][0]]
    assert inside, "no activation landed after an episode's first turn"
    done = inflight("replay", str(dialogue_run), "--verify-spans")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "verify spans: passed" in done.stdout
    consumed = {rid for c in read_records(dialogue_run) if isinstance(c, ConsumptionRecord) for rid in c.rollout_ids}
    assert len(consumed) == STEPS * 64  # every step consumed a whole batch of episodes


def test_a_tool_episode_records_the_tool_output_as_environment_tokens(tmp_path):
    from transformers import AutoTokenizer

    from tests.multi_turn_helpers import build_tool_model

    model = build_tool_model(ROOT / "models" / "tiny-rl", tmp_path / "tool-model")
    config = tmp_path / "calculator.toml"
    config.write_text(f'[engine]\nmodel = "{model}"\n[task]\nentrypoint = "tests.multi_turn_helpers:one_plus_two"\n'
                      '[sampling]\nmax_tokens = 64\n[scheduler]\ngroup_size = 8\nbatch_groups = 4\n'
                      '[run]\nmax_steps = 2\nprogress = "plain"\n')
    run_dir = tmp_path / "run"
    done = inflight("run", str(config), "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    tokenizer = AutoTokenizer.from_pretrained(model)
    records = [r for r in rollouts(run_dir) if r.status_name == "completed"]
    called = [r for r in records if r.turns == 2]
    assert called, f"no episode called the tool: {[r.episode_end for r in records]}"
    answers = []
    for r in called:
        (start, end), = r.environment_ranges()
        tool_text = tokenizer.decode(r.completion_tokens()[start:end].tolist())
        if tool_text.startswith("<|im_end|>"):
            # Only for a turn cut at its max_tokens (no stop token sampled): the environment's tokens
            # close the turn with the template's end first (docs/multi-turn.md), then the tool's.
            last = r.completion_tokens()[start - 1].item()
            assert last not in {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}, \
                tokenizer.decode(r.completion_tokens()[:start].tolist())[-200:]
            tool_text = tool_text[len("<|im_end|>"):]
        # the tool's answer (or its error, for a sampled call with wrong arguments) as a tool message
        assert tool_text.strip().startswith("<|im_start|>tool\n") and "<|im_end|>" in tool_text, tool_text
        answers.append(tool_text)
        assert all(math.isnan(x) for x in r.logprobs()[start:end])
    assert any("<|im_start|>tool\n3<|im_end|>" in t for t in answers), answers  # add(1, 2) answered
    ends = {r.episode_end for r in records}
    assert ends <= {"done", "malformed_tool_call", "max_turns", "max_episode_tokens"}  # a cut one is completed too
    assert all(r.finish_reason == "length" for r in records if r.episode_end == "max_episode_tokens")
    assert all(r.finish_reason in ("stop", "length") for r in records), "the engine's, recorded"
    assert all(r.rewards["reward"] == 0.0 for r in records if r.episode_end == "malformed_tool_call")
    consumed = {rid for c in read_records(run_dir) if isinstance(c, ConsumptionRecord) for rid in c.rollout_ids}
    assert consumed & {r.rollout_id for r in called}, "the trainer consumed no tool episode"
    verified = inflight("replay", str(run_dir), "--verify-spans")
    assert verified.returncode == 0 and "verify spans: passed" in verified.stdout, verified.stdout[-2000:]


def test_a_template_that_is_not_prefix_preserving_stops_the_run_at_start(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(ROOT / "models" / "tiny-rl", model)
    # Qwen3-style: an earlier assistant turn loses its reasoning once another message follows.
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' and not loop.last %}"
                "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (model / "chat_template.jinja").write_text(template)
    config = tmp_path / "bad.toml"
    config.write_text(f'[engine]\nmodel = "{model}"\n[task]\n'
                      'entrypoint = "orchestrator.tasks.toy_env:digits_dialogue"\n')
    done = inflight("run", str(config), "--run-dir", str(tmp_path / "run"), timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    assert "task.chat_template" in lines[-1] and "not prefix-preserving" in lines[-1], done.stderr[-2000:]
    assert "Traceback" not in done.stderr


def _small_run(tmp_path, task: str, server: tuple[Path, str], steps: int = 2) -> Path:
    """A short run of `task` on the session's shared server (`server`: its model and URL)."""
    model, url = server
    config = tmp_path / "agent.toml"
    config.write_text(f'[engine]\nmodel = "{model}"\n{attach_to(url)}[task]\n{task}\n[sampling]\nmax_tokens = 16\n[scheduler]\ngroup_size = 4\n'
                      f'batch_groups = 2\n[run]\nmax_steps = {steps}\nprogress = "plain"\n')
    run_dir = tmp_path / "run"
    done = inflight("run", str(config), "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return run_dir


def _consumed_episodes(run_dir: Path, turns: int) -> list[RolloutRecord]:
    records = {r.rollout_id: r for r in rollouts(run_dir)}
    consumed = [records[rid] for c in read_records(run_dir) if isinstance(c, ConsumptionRecord)
                for rid in c.rollout_ids]
    assert len(consumed) == 2 * 8  # both steps consumed a whole batch of episodes
    for r in consumed:
        assert r.status_name == "completed" and r.turns == turns and r.episode_end == "done"
        assert np.isnan(r.logprobs()[~r.sampled_mask()]).all() and np.isfinite(r.logprobs()[r.sampled_mask()]).all()
        assert 0.0 <= r.rewards["reward"] <= 1.0
    return consumed


def test_an_openai_client_agent_produces_episodes_the_trainer_consumes(tmp_path, rl_model, run_server):
    """With a template file of its own (task.chat_template as a path): the run renders with it,
    its identity hashes it, and RUN_DIR keeps the copy that export-model writes out."""
    import hashlib

    from orchestrator.run.recording import RUN_TEMPLATE, chat_template_of

    own = "{#- the run's own copy -#}\n" + chat_template_of(rl_model)
    (tmp_path / "own.jinja").write_text(own)
    run_dir = _small_run(tmp_path, 'agent = "orchestrator.tasks.toy_agent:digits_agent"\n'
                                   'entrypoint = "orchestrator.tasks.toy_agent:rows"\n'
                                   f'chat_template = "{tmp_path / "own.jinja"}"', (rl_model, run_server))
    consumed = _consumed_episodes(run_dir, turns=2)
    assert (run_dir / RUN_TEMPLATE).read_text() == own
    assert {r.identity.chat_template_hash for r in consumed} == {hashlib.sha256(own.encode()).hexdigest()[:16]}
    verified = inflight("replay", str(run_dir), "--verify-spans")
    assert verified.returncode == 0 and "verify spans: passed" in verified.stdout, verified.stdout[-2000:]


def test_a_verifiers_multi_turn_environment_produces_episodes_the_trainer_consumes(tmp_path, rl_model, run_server):
    run_dir = _small_run(tmp_path, 'entrypoint = "orchestrator.tasks.verifiers:make"\n'
                                   'args = {env = "tests.vf_toy_env", kind = "multi"}', (rl_model, run_server))
    _consumed_episodes(run_dir, turns=3)


def test_an_agent_task_without_the_http_server_stops_at_start_naming_the_field(tmp_path):
    config = tmp_path / "agent.toml"
    config.write_text('[task]\nagent = "orchestrator.tasks.toy_agent:digits_agent"\n'
                      'entrypoint = "orchestrator.tasks.toy_agent:rows"\n[http]\nenabled = false\n')
    done = inflight("run", str(config), "--run-dir", str(tmp_path / "run"), timeout=300)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    last = [line for line in done.stderr.strip().splitlines() if line.strip()][-1]
    assert "http.enabled" in last and "Traceback" not in done.stderr, done.stderr[-2000:]


def test_an_agents_sdk_agent_trains_through_inflight_run_and_its_spans_verify(tmp_path, tool_agent_dir):
    model = tool_agent_dir
    config = tmp_path / "sdk-agent.toml"
    config.write_text(f'[engine]\nmodel = "{model}"\n[task]\nagent = "tests.framework_agents:sdk_agent"\n'
                      'entrypoint = "orchestrator.tasks.toy_agent:rows"\n[sampling]\nmax_tokens = 64\n'
                      '[scheduler]\ngroup_size = 4\nbatch_groups = 2\n[run]\nmax_steps = 2\nprogress = "plain"\n')
    run_dir = tmp_path / "run"
    done = inflight("run", str(config), "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = {r.rollout_id: r for r in rollouts(run_dir)}
    consumed = [records[rid] for c in read_records(run_dir) if isinstance(c, ConsumptionRecord)
                for rid in c.rollout_ids]
    assert len(consumed) == 2 * 8 and all(r.status_name == "completed" for r in consumed)
    assert all(np.isfinite(r.logprobs()[r.sampled_mask()]).all() for r in consumed)
    # Episodes with a tool call and its result: the tool's answer is recorded as environment tokens.
    called = [r for r in consumed if r.turns >= 2 and r.environment_ranges()]
    assert called, [(r.turns, r.episode_end) for r in consumed]
    verified = inflight("replay", str(run_dir), "--verify-spans")
    assert verified.returncode == 0 and "verify spans: passed" in verified.stdout, verified.stdout[-2000:]
