"""verifiers 0.4's own `TrainClient`, from its own venv (`make verifiers-venv`: .venv-verifiers, built
here when missing), run by an agent (`task.agent`, the recipe of docs/agents.md), plays three
turns against one episode of the agent endpoint on a real vLLM engine (the in-process engine on
the tiny model): its base URL `{run}/e/{episode}/v1` sends its `/inference/v1/generate` calls
into that episode (orchestrator/tasks/token_route.py). The episode must be token-exact: the
client's prompts are what the engine was sent, the ids and logprobs it read back are what the
engine returned, the episode is the first prompt, every sampled token and exactly the tokens the
client's renderer added between turns; the logprobs are the model's on the episode so far (a
transformers forward)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from pathlib import Path

import msgspec
import pytest
from transformers import AutoTokenizer

from orchestrator.tasks.agent import AgentEpisodes, sampling_checker
from orchestrator.tasks.agent_endpoint import AgentEndpoint
from orchestrator.tasks.env import SampledTurn
from orchestrator.tasks.templates import engine_stop_ids
from orchestrator.tasks.turns import TurnRenderer
from replay.records import SamplingSettings
from tests.agent_helpers import served
from tests.reference import reference_logprobs

pytestmark = [pytest.mark.engine, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "verifiers04" / "train_client_turns.py"
# Turns end on eos, as verifiers' renderer asks (its stop ids must be ones the run stops on).
SAMPLING = SamplingSettings(seed=11)
_ids = itertools.count()


class EngineSampler:
    """The run's part, reduced: one engine request per turn; keeps what the engine returned."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.turns: list[tuple[list[int], list[int], list[float]]] = []  # (prompt, tokens, logprobs)

    async def __call__(self, prompt: list[int], max_new: int) -> SampledTurn:
        sampling = msgspec.structs.replace(SAMPLING, max_tokens=max_new)
        ids, logprobs, reason = [], [], None
        async for chunk in self.engine.generate(f"vf04-{next(_ids)}", prompt, sampling, final_only=True):
            ids += chunk.token_ids
            logprobs += chunk.logprobs
            reason = chunk.finish_reason or reason
        self.turns.append((list(prompt), list(ids), list(logprobs)))
        return SampledTurn(ids, logprobs, [(0, 0)], reason)


def verifiers04_agent(python: Path, turns: list[dict]):
    """The recipe of docs/agents.md: an agent (`task.agent`) whose episode verifiers 0.4 plays in its
    own venv, its TrainClient pointed at the episode's URL; the reward: the share of digits in
    the replies (the toy agent's). `turns` gets what the client read, turn by turn."""

    def run(client, row) -> float:
        url = str(client.base_url).rstrip("/")  # the episode's: {run}/e/{episode}/v1
        done = subprocess.run([str(python), str(SCRIPT), url, row["model_dir"], "3"], capture_output=True, text=True,
                              env={**os.environ, "INFLIGHT_TOKEN": client.api_key}, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(done.stderr[-3000:])
        turns.extend(json.loads(line) for line in done.stdout.splitlines() if line.startswith("{"))
        text = "".join(t["content"] or "" for t in turns)
        return sum(c.isdigit() for c in text) / max(len(text), 1)
    return run


async def test_verifiers_own_train_client_plays_three_turns_into_one_token_exact_episode(
        inproc_engine, tiny_model_dir, verifiers04_python, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = TurnRenderer(tokenizer, stop_ids=engine_stop_ids(tokenizer, tiny_model_dir, SAMPLING))
    endpoint = AgentEndpoint(renderer, token="t", sampling_check=sampling_checker(SAMPLING))
    sampler, turns = EngineSampler(inproc_engine), []
    agent = verifiers04_agent(verifiers04_python, turns)
    async with served(endpoint, tmp_path) as url:
        ep = await AgentEpisodes(agent, endpoint, lambda: url, timeout_s=600).run_episode(
            {"model_dir": str(tiny_model_dir)}, sampler, 16)
    assert len(turns) == 3 and [t["bridged"] for t in turns] == [False, True, True], turns
    # what the client sent is what the engine was sent; what it read back, what the engine returned
    assert [t["prompt_ids"] for t in turns] == [prompt for prompt, _, _ in sampler.turns]
    assert [t["completion_ids"] for t in turns] == [ids for _, ids, _ in sampler.turns]
    assert [t["logprobs"] for t in turns] == [lps for _, _, lps in sampler.turns]
    # the episode: the first prompt, each turn's sampled ids, and between turns exactly what the
    # client's renderer added (the closing token when a reply was cut, the next user message)
    assert ep.prompt_ids == turns[0]["prompt_ids"] and ep.turns == 3
    assert ep.next_prompt() == turns[2]["prompt_ids"] + turns[2]["completion_ids"]
    sampled = [t for t, s in zip(ep.tokens, ep.sampled) if s]
    assert sampled == sum((t["completion_ids"] for t in turns), [])
    assert ep.logprobs == sum((t["logprobs"] for t in turns), [])
    added = [turns[k]["prompt_ids"][len(turns[k - 1]["prompt_ids"]) + len(turns[k - 1]["completion_ids"]):]
             for k in (1, 2)]
    assert [ep.tokens[a:b] for a, b in ep.spans] == added and all(added)
    text = "".join(t["content"] or "" for t in turns)
    assert ep.reward == pytest.approx(sum(c.isdigit() for c in text) / max(len(text), 1)), "what the agent returned"
    for k, (prompt, ids, logprobs) in enumerate(sampler.turns):
        expected = reference_logprobs(str(tiny_model_dir), prompt, ids)
        assert max(abs(a - b) for a, b in zip(logprobs, expected)) < 1e-3, f"turn {k + 1}"


# -- a verifiers 0.4 environment through `inflight run` (orchestrator.tasks.verifiers04) ------------

def _trace_tokens(trace: dict) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the prompt's ids, the sampled ids) of a one-turn verifiers trace, from its message nodes (the
    assistant's node opens with the generation prompt, unmasked, then its sampled tokens)."""
    tokens = [t for n in trace["nodes"] for t in n["token_ids"]]
    mask = [m for n in trace["nodes"] for m in n["mask"]]
    first = mask.index(True)
    assert all(mask[first:]), "one turn: every token after the prompt was sampled"
    return tuple(tokens[:first]), tuple(tokens[first:])


def test_a_verifiers04_environment_with_a_local_runtime_trains_through_the_run(
        tmp_path, rl_model, run_server, verifiers04_python):
    """The toy 0.4 environment (tests/verifiers04/toy_env04.py, beside the config as a user's module
    is) with verifiers' `null` harness in the `subprocess` runtime: two steps of `inflight run`."""
    from replay.log import read_records
    from replay.records import ConsumptionRecord, RolloutRecord
    from tests.helpers import attach_to
    from tests.integration.test_multi_turn_run import inflight

    shutil.copy(ROOT / "tests" / "verifiers04" / "toy_env04.py", tmp_path / "toy_env04.py")
    renderer = ROOT / "tests" / "verifiers04" / "chatml_renderer.py"
    traces = tmp_path / "traces"
    config = tmp_path / "vf04.toml"
    config.write_text(
        f'[engine]\nmodel = "{rl_model}"\n{attach_to(run_server)}[task]\n'
        'entrypoint = "orchestrator.tasks.verifiers04:make"\n'
        f'args = {{env = "toy_env04", harness = "null", runtime = "subprocess", taskset = {{num_tasks = 4}}, '
        f'renderer = {{name = "custom", import_path = "{renderer}:ChatMLBridge"}}, '
        f'venv = "{verifiers04_python.parents[1]}", trace_dir = "{traces}"}}\n'
        '[sampling]\nmax_tokens = 16\n[scheduler]\ngroup_size = 4\nbatch_groups = 2\n'
        '[run]\nmax_steps = 2\nprogress = "plain"\n')
    run_dir = tmp_path / "run"
    done = inflight("run", str(config), "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    records = {r.rollout_id: r for r in read_records(run_dir) if isinstance(r, RolloutRecord)}
    consumed = [records[rid] for c in read_records(run_dir) if isinstance(c, ConsumptionRecord)
                for rid in c.rollout_ids]
    assert len(consumed) == 2 * 8, "both steps consumed a whole batch of episodes"
    episodes = [json.loads(line)["episode"] for f in traces.glob("*.jsonl") for line in f.read_text().splitlines()]
    by_tokens = {_trace_tokens(e["traces"][0]): e["traces"][0] for e in episodes if e["ok"]}
    for r in consumed:
        assert r.status_name == "completed" and r.turns == 1 and r.episode_end == "done"
        trace = by_tokens[(tuple(r.prompt_tokens().tolist()), tuple(r.completion_tokens().tolist()))]
        reward = sum(v["score"] * v["weight"] for v in trace["rewards"].values())
        assert r.rewards["reward"] == pytest.approx(reward), "the episode's reward is its trace's"
        assert trace["agent"]["config"]["runtime"]["type"] == "subprocess"
    assert len({r.rewards["reward"] for r in consumed}) > 1, "rewards that differ: the trainer has a signal"
    verified = inflight("replay", str(run_dir), "--verify-spans")
    assert verified.returncode == 0 and "verify spans: passed" in verified.stdout, verified.stdout[-2000:]
