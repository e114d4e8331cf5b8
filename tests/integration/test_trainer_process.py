"""The trainer process over its link (no vLLM): Ready, steps, checkpoint-then-publish, a
SIGKILL and --resume that re-publishes a version lost in the crash, a wrong step refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import msgspec
import numpy as np
import pytest

from orchestrator.config.run import RunConfig, TrainerConfig, TransportConfig
from orchestrator.trainer import checkpoint
from orchestrator.trainer.link import (
    Batch,
    Failed,
    Ready,
    Sample,
    StepDone,
    Stop,
    TrainerLink,
    pack_f32,
    pack_i32,
    unpack_f32,
)
from tests.helpers import load_safetensors_dir

pytestmark = [pytest.mark.slow, pytest.mark.light_lane]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def rl_model_dir(rl_model) -> Path:
    return rl_model  # the session's tiny-rl (tests/conftest.py)


def _samples(model_dir: Path, step: int, groups: int = 2, group_size: int = 4) -> list[Sample]:
    """Random prompt/completion tokens, with logprobs from a transformers forward of the base
    model: what an engine serving version 0 would have recorded."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = np.random.default_rng(step)
    out = []
    for j in range(groups * group_size):
        prompt = rng.integers(3, 1024, size=int(rng.integers(3, 9))).tolist()
        completion = rng.integers(3, 1024, size=int(rng.integers(1, 7))).tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + completion])).logits[0]
        logprobs = torch.log_softmax(logits[len(prompt) - 1:-1], -1)[torch.arange(len(completion)),
                                                                     torch.tensor(completion)]
        out.append(Sample(rollout_id=step * 100 + j, group_id=step * 10 + j // group_size,
                          prompt_token_ids=pack_i32(prompt), completion_token_ids=pack_i32(completion),
                          logprobs=pack_f32(logprobs.tolist()), reward=float(rng.random()), dispatched_version=0))
    return out


class _Trainer:
    """A trainer process and the link bound for it (one link per process)."""

    def __init__(self, run_dir: Path, model_dir: Path, config: RunConfig, resume: bool, log: Path):
        self.link = TrainerLink()
        address = self.link.bind()
        args = [sys.executable, "-m", "orchestrator.trainer.process", "--connect", address, "--run-dir", str(run_dir),
                "--model", str(model_dir), "--config-json", msgspec.json.encode(config).decode()]
        self.stderr = open(log, "ab")  # noqa: SIM115 - closed by close()
        self.proc = subprocess.Popen(args + (["--resume"] if resume else []), cwd=REPO, stderr=self.stderr,
                                     env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})

    async def recv(self, timeout_s: float = 120.0):
        return await self.link.recv(timeout_s)

    async def step(self, step: int, samples: list[Sample]):
        await self.link.send(Batch(step=step, samples=samples))
        return await self.recv()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        self.link.close()
        self.stderr.close()


def _published(run_dir: Path, version: int) -> dict:
    vdir = run_dir / "weights" / f"v{version:08d}"
    assert (vdir / "COMPLETE").exists()
    return load_safetensors_dir(vdir)


def _assert_same(published: dict, run_dir: Path, step: int) -> None:
    import torch
    from safetensors.torch import load_file

    saved = load_file(checkpoint.checkpoint_dir(run_dir, step) / checkpoint.MODEL_FILE)
    assert published.keys() == saved.keys()
    for name, tensor in saved.items():
        assert published[name].dtype == torch.float32
        assert torch.equal(published[name], tensor), name


def _config(**trainer) -> RunConfig:
    # Checkpoints written before each publish (the order these tests check step by step);
    # background checkpoints: tests/unit/test_checkpoint_background.py and the crash/resume runs.
    fields = {"threads": 1, "checkpoint_background": False, **trainer}
    return RunConfig(trainer=TrainerConfig(**fields), transport=TransportConfig(keep_last=8)).validate()


@pytest.mark.timeout(400)
async def test_steps_publish_checkpointed_versions_and_resume_after_sigkill(tmp_path, rl_model_dir):
    run_dir, log = tmp_path / "run", tmp_path / "trainer.log"
    config = _config()
    trainer = _Trainer(run_dir, rl_model_dir, config, resume=False, log=log)
    try:
        ready = await trainer.recv()
        assert isinstance(ready, Ready), ready
        assert (ready.step, ready.version, ready.resumed, ready.pid) == (0, 0, False, trainer.proc.pid)
        assert ready.weights_root == str(run_dir / "weights")
        assert "model.embed_tokens.weight" in ready.plan_json

        first = _samples(rl_model_dir, 1)
        done = await trainer.step(1, first)
        assert isinstance(done, StepDone), done
        assert (done.step, done.version) == (1, 1)
        assert done.rollout_ids == [s.rollout_id for s in first]
        assert len(unpack_f32(done.advantages)) == len(first)
        # The trainer holds version 0, which recorded these logprobs: the log-ratios vanish.
        assert np.abs(unpack_f32(done.log_ratio_mean)).max() < 1e-3
        assert np.abs(unpack_f32(done.log_ratio_max_abs)).max() < 1e-3
        assert done.metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-3)
        assert done.metrics["staleness_max"] == 0.0
        _assert_same(_published(run_dir, 1), run_dir, 1)

        done = await trainer.step(2, _samples(rl_model_dir, 2))
        assert isinstance(done, StepDone) and (done.step, done.version) == (2, 2)
        assert done.metrics["staleness_max"] == 1.0
        # Version 1 moved the weights: the base model's logprobs no longer match.
        assert np.abs(unpack_f32(done.log_ratio_max_abs)).max() > 1e-3
        v2 = _published(run_dir, 2)
        _assert_same(v2, run_dir, 2)

        wrong = await trainer.step(5, _samples(rl_model_dir, 5))
        assert isinstance(wrong, Failed) and wrong.step == 5
        assert "step 5" in wrong.error and "expected step 3" in wrong.error

        trainer.proc.send_signal(signal.SIGKILL)
        assert trainer.proc.wait(30) == -signal.SIGKILL
    finally:
        trainer.close()

    # As if the crash came between the checkpoint of step 2 and the publishing of version 2.
    import shutil

    shutil.rmtree(run_dir / "weights" / "v00000002")
    meta = checkpoint.latest(run_dir)
    assert meta is not None and (meta.step, meta.version) == (2, 2)
    assert meta.consumption.rollout_ids == done.rollout_ids
    assert checkpoint.complete_steps(run_dir) == [1, 2]

    trainer = _Trainer(run_dir, rl_model_dir, config, resume=True, log=log)
    try:
        ready = await trainer.recv()
        assert isinstance(ready, Ready), ready
        assert (ready.step, ready.version, ready.resumed) == (2, 2, True)
        republished = _published(run_dir, 2)
        _assert_same(republished, run_dir, 2)
        assert all(np.array_equal(republished[k].numpy(), v2[k].numpy()) for k in v2)  # the same weight set

        done = await trainer.step(3, _samples(rl_model_dir, 3))
        assert isinstance(done, StepDone) and (done.step, done.version) == (3, 3)
        _assert_same(_published(run_dir, 3), run_dir, 3)
        assert checkpoint.complete_steps(run_dir) == [2, 3]  # keep_checkpoints = 2
        await trainer.link.send(Stop())
        assert trainer.proc.wait(60) == 0
    finally:
        trainer.close()


@pytest.mark.timeout(300)
async def test_publish_every_two_skips_odd_steps_and_a_fresh_start_refuses_a_used_run_dir(tmp_path, rl_model_dir):
    run_dir, log = tmp_path / "run", tmp_path / "trainer.log"
    config = _config(publish_every=2, loss="ppo")
    trainer = _Trainer(run_dir, rl_model_dir, config, resume=False, log=log)
    try:
        assert isinstance(await trainer.recv(), Ready)
        done = await trainer.step(1, _samples(rl_model_dir, 1))
        assert isinstance(done, StepDone) and done.version is None
        assert not (run_dir / "weights" / "v00000001").exists() and checkpoint.latest(run_dir) is None
        done = await trainer.step(2, _samples(rl_model_dir, 2))
        assert isinstance(done, StepDone) and done.version == 2
        _assert_same(_published(run_dir, 2), run_dir, 2)
        # A step that raises (here: one logprob too many) answers Failed naming it, and exits 1.
        bad = _samples(rl_model_dir, 3)
        bad[0] = msgspec.structs.replace(bad[0], logprobs=bad[0].logprobs + pack_f32([-1.0]))
        failed = await trainer.step(3, bad)
        assert isinstance(failed, Failed) and failed.step == 3 and "logprobs" in failed.error
        assert trainer.proc.wait(60) == 1
    finally:
        trainer.close()

    # Without --resume, a run directory with checkpoints is refused rather than overwritten.
    trainer = _Trainer(run_dir, rl_model_dir, config, resume=False, log=log)
    try:
        failed = await trainer.recv()
        assert isinstance(failed, Failed) and failed.step is None
        assert "--resume" in failed.error
        assert trainer.proc.wait(60) == 1
    finally:
        trainer.close()


def test_every_message_round_trips_through_the_one_decoder():
    from orchestrator.trainer.link import decode, encode, unpack_i32

    sample = Sample(rollout_id=7, group_id=2, prompt_token_ids=pack_i32([1, 2, 3]), completion_token_ids=pack_i32([9]),
                    logprobs=pack_f32([-0.5]), reward=0.25, dispatched_version=4)
    messages = [
        Batch(step=3, samples=[sample, sample]),
        Stop(),
        Ready(step=2, version=2, plan_json="{}", weights_root="/r/weights", pid=11, resumed=True),
        StepDone(step=3, version=None, loss=0.1, reward_mean=0.5, metrics={"kl_k3": 0.01}, seconds=0.2,
                 rollout_ids=[7], advantages=pack_f32([1.0]), log_ratio_mean=pack_f32([float("nan")]),
                 log_ratio_max_abs=pack_f32([0.0])),
        Failed(step=None, error="boom"),
    ]
    for msg in messages:
        back = decode(encode(msg))
        assert type(back) is type(msg)
        if isinstance(msg, StepDone):
            assert np.isnan(unpack_f32(back.log_ratio_mean)[0])
        else:
            assert back == msg
    assert unpack_i32(sample.prompt_token_ids).tolist() == [1, 2, 3]
    assert pack_i32([1]) == b"\x01\x00\x00\x00"  # little-endian on every host
    assert encode(Stop()) == encode(Stop()) and b"type" in encode(Stop())


@pytest.mark.timeout(60)
async def test_link_and_client_talk_and_every_wait_is_bounded():
    import anyio

    from orchestrator.trainer.link import (
        TrainerClient,
        TrainerLinkError,
        TrainerLinkTimeout,
        decode,
    )

    link = TrainerLink()
    address = link.bind()
    assert address.startswith("tcp://127.0.0.1:")
    try:
        with pytest.raises(TrainerLinkTimeout, match="delivery of Stop"):
            await link.send(Stop(), timeout_s=0.2)  # nobody connected yet
        with pytest.raises(TrainerLinkTimeout):
            await link.recv(timeout_s=0.1)
        client = TrainerClient()
        client.connect(address)
        try:
            client.send(Failed(step=1, error="x"))
            assert await link.recv(timeout_s=10) == Failed(step=1, error="x")
            await link.send(Batch(step=1, samples=[]), timeout_s=10)
            got = await anyio.to_thread.run_sync(lambda: client.recv(timeout_s=10))
            assert got == Batch(step=1, samples=[])
            with pytest.raises(TrainerLinkTimeout):
                client.recv(timeout_s=0.05)
        finally:
            client.close()
        with pytest.raises(TrainerLinkError, match="undecodable"):
            decode(b"\x93garbage")
    finally:
        link.close()


def _start(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=REPO)


def _gone(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return True
    return "State:\tZ" in status  # exited, waiting for a reaper that may never come in a container


@pytest.mark.wall_clock  # the orphaned trainer must be gone within 30 s
@pytest.mark.timeout(180)
async def test_the_trainer_exits_when_its_parent_is_gone(tmp_path, rl_model_dir):
    """The orchestrator crashed without a Stop: the trainer notices its new parent and exits."""
    import time

    import anyio

    link = TrainerLink()
    address = link.bind()
    args = [sys.executable, "-m", "orchestrator.trainer.process", "--connect", address, "--run-dir",
            str(tmp_path / "run"), "--model", str(rl_model_dir), "--config-json",
            msgspec.json.encode(_config()).decode()]
    # A stand-in orchestrator: starts the trainer, then waits to be killed.
    parent = _start([sys.executable, "-c", ("import subprocess, sys, time; "
                                            "subprocess.Popen(sys.argv[1:], stderr=subprocess.DEVNULL); time.sleep(600)"),
                     *args])
    ready = None
    try:
        ready = await link.recv(120)
        assert isinstance(ready, Ready)
        parent.kill()
        parent.wait(30)
        deadline = time.monotonic() + 30
        while not _gone(ready.pid) and time.monotonic() < deadline:
            await anyio.sleep(0.2)
        assert _gone(ready.pid)
    finally:
        if parent.poll() is None:
            parent.kill()
        if ready is not None and not _gone(ready.pid):
            os.kill(ready.pid, signal.SIGKILL)
        link.close()
