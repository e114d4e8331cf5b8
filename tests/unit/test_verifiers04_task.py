"""The verifiers 0.4 task (orchestrator/tasks/verifiers04.py) and its driver process: what it
refuses, by name, before any driver starts; and what a driver's faults do to episodes. The driver is
the real one, in the 0.4 venv (`make verifiers-venv`, built here when missing), playing
tests/verifiers04/faulty_env04.py with verifiers' `null` harness in the subprocess runtime against
the run's endpoint served on 127.0.0.1, a scripted sampler in place of the engine (the faults are
the driver's; the engine's part: tests/integration/test_verifiers04.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from orchestrator.errors import ConfigError
from orchestrator.tasks.agent import AgentEpisodes, AgentError, sampling_checker
from orchestrator.tasks.agent_endpoint import AgentEndpoint
from orchestrator.tasks.turns import TurnRenderer
from orchestrator.tasks.verifiers04 import make
from replay.records import SamplingSettings
from tests.agent_helpers import TOKEN, Script, served

pytestmark = [pytest.mark.timeout(900), pytest.mark.light_lane]
ROOT = Path(__file__).resolve().parents[2]
HERE = ROOT / "tests" / "verifiers04"
RENDERER = {"name": "custom", "import_path": f"{HERE / 'chatml_renderer.py'}:ChatMLBridge"}


@pytest.mark.parametrize(("runtime", "named"), [("prime", "Prime sandboxes"), ("modal", "Modal"), ("e2b", "E2B"),
                                                ({"type": "modal", "gpu": "A100"}, "Modal")])
def test_a_remote_runtime_is_refused_by_name(runtime, named, tmp_path):
    with pytest.raises(ConfigError) as caught:
        make(env="toy_env04", runtime=runtime, venv=str(tmp_path / "none"), model_dir=str(tmp_path))
    assert caught.value.field == "task.args.runtime"
    assert named in caught.value.reason and "remote runtime: refused" in caught.value.reason


def test_other_runtimes_and_docker_without_docker_are_refused_naming_the_field(tmp_path, monkeypatch):
    for runtime in ("podman", "apptainer", "kubernetes", {"image": "x"}, 3):
        with pytest.raises(ConfigError) as caught:
            make(env="toy_env04", runtime=runtime, venv=str(tmp_path / "none"), model_dir=str(tmp_path))
        assert caught.value.field == "task.args.runtime", runtime
    monkeypatch.setenv("PATH", str(tmp_path))  # no docker command here
    with pytest.raises(ConfigError) as caught:
        make(env="toy_env04", runtime="docker", venv=str(tmp_path / "none"), model_dir=str(tmp_path))
    assert caught.value.field == "task.args.runtime" and "docker command" in caught.value.reason


def test_a_missing_venv_is_named_with_how_to_build_it(tmp_path):
    with pytest.raises(ConfigError) as caught:
        make(env="toy_env04", venv=str(tmp_path / "no-venv"), model_dir=str(tmp_path))
    assert caught.value.field == "task.args.venv"
    assert str(tmp_path / "no-venv") in caught.value.reason and "make verifiers-venv" in caught.value.reason


def test_an_environment_the_driver_cannot_find_or_configure_is_named_at_start(verifiers04_python, tiny_model_dir):
    with pytest.raises(ConfigError) as caught:
        make(env="no_such_env04", venv=str(verifiers04_python.parents[1]), model_dir=str(tiny_model_dir),
             start_timeout_s=300)
    assert caught.value.field == "task.args.env" and "no_such_env04" in caught.value.reason
    with pytest.raises(ConfigError) as caught:
        make(env="toy_env04", taskset={"num_taskz": 3}, venv=str(verifiers04_python.parents[1]),
             model_dir=str(tiny_model_dir), search_path=[str(HERE)], start_timeout_s=300)
    assert caught.value.field == "task.args" and "num_taskz" in caught.value.reason


def test_through_the_run_a_remote_runtime_stops_it_at_start_naming_the_field(tmp_path):
    import subprocess

    config = tmp_path / "vf04.toml"
    config.write_text('[task]\nentrypoint = "orchestrator.tasks.verifiers04:make"\n'
                      'args = {env = "toy_env04", runtime = "e2b"}\n')
    done = subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", "run", str(config), "--run-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    last = [line for line in done.stderr.splitlines() if line.strip()][-1]
    assert "task.args.runtime" in last and "E2B" in last and "Traceback" not in done.stderr


@pytest.mark.wall_clock  # a restarted driver (a process importing verifiers) answers within timeout_s = 8
async def test_a_driver_that_dies_mid_episode_ends_it_named_and_the_next_episode_runs(
        verifiers04_python, tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    renderer = TurnRenderer(tokenizer)
    endpoint = AgentEndpoint(renderer, token=TOKEN, sampling_check=sampling_checker(SamplingSettings()))
    task = make(env="faulty_env04", harness="null", runtime="subprocess", renderer=RENDERER, timeout_s=8,
                venv=str(verifiers04_python.parents[1]), model_dir=str(tiny_model_dir), search_path=[str(HERE)],
                start_timeout_s=300)
    try:
        assert [task.row(i)["name"] for i in range(len(task))] == ["exit", "fine", "hang", "raise"]
        async with served(endpoint, tmp_path) as url:
            episodes = AgentEpisodes(task.run, endpoint, lambda: url, timeout_s=120)

            sampler = Script(renderer, ["12 34"])
            with pytest.raises(AgentError, match=r"driver died \(exit code 9\) during the episode"):
                await episodes.run_episode(task.row(0), sampler, 16)
            assert len(sampler.prompts) == 1, "it died after its model turn: mid-episode"

            sampler = Script(renderer, ["12 34"])  # the next episode: a new driver, a reward
            episode = await episodes.run_episode(task.row(1), sampler, 16)
            assert task.link.starts == 2 and episode.turns == 1
            assert episode.reward == pytest.approx(4 / 5), "the trace's reward: digits in '12 34'"

            sampler = Script(renderer, ["5"])  # one that never ends: past timeout_s, cancelled, named
            with pytest.raises(AgentError, match=r"no answer in 8 s \(task.args.timeout_s\): cancelled"):
                await episodes.run_episode(task.row(2), sampler, 16)
            with pytest.raises(AgentError, match=r"rollout failed: .*no score for this one"):
                await episodes.run_episode(task.row(3), Script(renderer, ["5"]), 16)  # a failed rollout: no reward
            episode = await episodes.run_episode(task.row(1), Script(renderer, ["7a"]), 16)
            assert episode.reward == pytest.approx(1 / 2) and task.link.starts == 2, "the same driver goes on"

            # That driver completed an episode: it earned a restart. One that dies before completing
            # any is not started again.
            for starts in (2, 3):
                with pytest.raises(AgentError, match="driver died"):
                    await episodes.run_episode(task.row(0), Script(renderer, ["1"]), 16)
                assert task.link.starts == starts
            with pytest.raises(AgentError, match="died again after its restart: not started again"):
                await episodes.run_episode(task.row(1), Script(renderer, ["1"]), 16)
            assert task.link.starts == 3
    finally:
        task.close()
    assert task.link._proc is None
