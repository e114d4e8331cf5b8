"""The built-in trainer under torchrun with FSDP2 over 2 gloo ranks (trainer.world_size = 2),
started by the orchestrator's own launcher and driven over its link, publishing through the
filesystem transport into a live vLLM engine.

Per step: the batch is sampled from the engine at the live version; the trainer's sharded
forward agrees with the engine's logprobs of it; the step equals a single-process step on the
same batch; the published version, activated in the engine, gives the logprobs of a
single-process transformers forward of the published weights; each rank's extra memory while
publishing stays within two buckets plus the largest tensor. Then a torchrun trainer resumes
from the gathered checkpoint and its next step still equals the single-process one. A LoRA
run (trainer.lora) publishes, under torchrun, the adapter a single process publishes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import anyio
import msgspec
import numpy as np
import pytest
import torch

from orchestrator.config.run import LoraConfig, RunConfig, TrainerConfig, TransportConfig
from orchestrator.engines.base import SamplingSettings
from orchestrator.trainer import checkpoint
from orchestrator.trainer.launcher import descendants
from orchestrator.trainer.link import (
    Batch,
    Ready,
    Sample,
    StepDone,
    pack_f32,
    pack_i32,
    unpack_f32,
)
from tests.helpers import load_safetensors_dir
from transports.adapters import ADAPTER_CONFIG, ADAPTER_MODEL, adapter_dir, check_adapter

pytestmark = [pytest.mark.engine, pytest.mark.slow]

TOL = 1e-3  # fp32 logprobs, engine vs transformers
BUCKET = 256 << 10  # several buckets for the tiny model (its embedding, 512 KiB, travels alone)
ATOL_WEIGHTS = 1e-4  # a published weight against the one-process reference: a thirtieth of a step (lr 3e-3)
GROUPS, GROUP_SIZE = 2, 4
SAMPLE = SamplingSettings(temperature=1.0, max_tokens=6, ignore_eos=True)
GREEDY = SamplingSettings(temperature=0.0, max_tokens=10, ignore_eos=True)
PROBE = [5, 17, 42, 8, 23, 11, 3, 29] * 2


@pytest.fixture(scope="module")
async def engine(tiny_model_dir):
    from orchestrator.config.run import EngineConfig
    from orchestrator.engines.inproc import InProcessEngine

    e = InProcessEngine(EngineConfig(model=str(tiny_model_dir), kind="inproc", max_model_len=256, max_num_seqs=16,
                                     worker_extension_cls="transports.swap.SwapWorkerExtension"), "fsdp-inproc")
    await e.start()
    try:
        yield e
    finally:
        await e.shutdown()


def _config(world_size: int) -> RunConfig:
    # kl_target: on-policy batches keep the rate; step 5's, one version old, moves it (below 2e-6).
    return RunConfig(trainer=TrainerConfig(threads=1, world_size=world_size, bucket_bytes=BUCKET, kl_target=1e-6),
                     transport=TransportConfig(keep_last=8)).validate()


async def _batch(fleet, step: int) -> list[Sample]:
    """GROUPS x GROUP_SIZE rollouts sampled from the engine at its live version, with the
    engine's own logprobs; rewards vary within each group (non-zero advantages)."""
    rng = np.random.default_rng(step)
    out = []
    for g in range(GROUPS):
        prompt = rng.integers(3, 1000, size=6).tolist()
        for j in range(GROUP_SIZE):
            c = await fleet.generate(prompt, msgspec.structs.replace(SAMPLE, seed=100 * step + 10 * g + j))
            assert c.status == "completed", c
            assert set(c.versions) == {step - 1}
            out.append(Sample(rollout_id=100 * step + GROUP_SIZE * g + j, group_id=10 * step + g,
                              prompt_token_ids=pack_i32(prompt), completion_token_ids=pack_i32(c.token_ids),
                              logprobs=pack_f32(c.logprobs), reward=float(np.mean(np.array(c.token_ids) % 2)) + 0.1 * j,
                              dispatched_version=step - 1))
    return out


def _published(run_dir: Path, version: int) -> dict[str, torch.Tensor]:
    vdir = run_dir / "weights" / f"v{version:08d}"
    assert (vdir / "COMPLETE").exists(), vdir
    return load_safetensors_dir(vdir)


def _tail(run_dir: Path) -> str:
    path = run_dir / "trainer.log"
    return path.read_text(errors="replace")[-6000:] if path.exists() else "(no trainer.log)"


class _Reference:
    """One process, the same code path as a world_size = 1 trainer (`train_step`)."""

    def __init__(self, model_dir: Path, config: RunConfig):
        from transformers import AutoModelForCausalLM

        self.config = config
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=config.trainer.lr,
                                          weight_decay=config.trainer.weight_decay)
        pad = self.model.config.pad_token_id
        self.pad_id = int(pad) if pad is not None else 0

    def step(self, samples: list[Sample], step: int):
        from orchestrator.trainer.process import train_step

        return train_step(self.model, self.optimizer, samples, self.config.trainer, self.pad_id, step=step,
                          temperature=self.config.sampling.temperature)

    def state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.model.state_dict().items()}


def _check_step(done, ref, run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The sharded step is the single-process step; returns the published weights."""
    assert isinstance(done, StepDone), f"{done}\n{_tail(run_dir)}"
    assert (done.step, done.version) == (step, step)
    # The trainer's forward before the step (sharded, each rank its slice) is the engine's.
    assert np.nanmax(unpack_f32(done.log_ratio_max_abs)) < TOL, unpack_f32(done.log_ratio_max_abs)
    assert done.loss == pytest.approx(ref.loss, rel=1e-4, abs=1e-6)
    assert done.metrics["tokens"] == ref.metrics["tokens"]
    # A ratio of ~1 (on-policy samples), after steps whose weights differ by summation order
    # (above): 1.1e-5 apart on one machine. A ratio against the wrong logprobs is off by far more.
    assert done.metrics["ratio_max"] == pytest.approx(ref.metrics["ratio_max"], abs=1e-4)
    assert done.metrics["grad_norm"] == pytest.approx(ref.metrics["grad_norm"], rel=1e-4)
    assert done.metrics["lr"] == ref.metrics["lr"]
    np.testing.assert_allclose(unpack_f32(done.log_ratio_mean), np.asarray(ref.log_ratio_mean, dtype=np.float32),
                               atol=1e-5)
    # Extra memory on each rank while publishing, counted (the arenas, and the gathered tensors
    # alive at once): within two buckets plus the largest tensor. Resident memory: see the
    # last test (on this tiny model the interpreter's own noise is a third of the bound).
    bound = done.metrics["publish_bound_bytes"]
    for rank in (0, 1):
        assert done.metrics[f"publish_counted_bytes_rank{rank}"] <= bound, (rank, done.metrics)
    assert done.metrics["publish_gathered_peak_bytes_rank0"] == 512 << 10  # the embedding, alone
    assert done.metrics["publish_gathered_peak_bytes_rank1"] == 0  # sends from its own shards
    return _published(run_dir, step)


def _assert_close_weights(published: dict, reference: dict) -> None:
    assert published.keys() == reference.keys()
    for name, tensor in reference.items():
        assert published[name].dtype == torch.float32
        # Adam's first steps move every weight by about lr = 3e-3; a summation order that
        # differs (two shards) changes them by far less: one element of 16,384 was 2.08e-5 apart on
        # one machine (2026-12-06), every run alike (likely a near-zero gradient, whose rounding
        # Adam's normalised update magnifies; not isolated). A step missed, repeated or misapplied
        # moves ~lr.
        diff = (published[name] - tensor).abs()
        assert float(diff.max()) <= ATOL_WEIGHTS, (f"{name}: {int((diff > ATOL_WEIGHTS).sum())} of {diff.numel()} "
                                                   f"elements apart by up to {float(diff.max()):.3g}")


@pytest.mark.timeout(600)
async def test_three_fsdp_steps_under_torchrun_publish_into_a_live_engine_and_resume(engine, tiny_model_dir,
                                                                                    tmp_path):
    from orchestrator.fleet.fleet import Fleet
    from orchestrator.trainer.launcher import TrainerProcess
    from tests.integration.activation_helpers import References, max_err

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = _config(world_size=2)
    ref = _Reference(tiny_model_dir, config)
    refs = References(tiny_model_dir)
    fleet = Fleet([engine], strategy="pause_swap", kv_policy="recompute", live_version=0)

    trainer = TrainerProcess(config, run_dir, str(tiny_model_dir), resume=False)
    try:
        ready = await trainer.start()
        assert isinstance(ready, Ready) and (ready.step, ready.version, ready.resumed) == (0, 0, False)
        assert ready.pid != trainer.process.pid  # rank 0 is a worker of torchrun's agent
        await fleet.setup(ready.plan_json, ready.weights_root)
        for step in (1, 2, 3):
            samples = await _batch(fleet, step)
            await trainer.link.send(Batch(step=step, samples=samples))
            done = await trainer.link.recv(300)
            expected = ref.step(samples, step)
            published = _check_step(done, expected, run_dir, step)
            _assert_close_weights(published, ref.state())
            # Live in the engine: its logprobs are a single-process forward of the published weights.
            record = await fleet.activate(step)
            assert record.outcome == "activated", record
            refs.add(step, published)
            c = await fleet.generate(PROBE, GREEDY)
            assert set(c.versions) == {step}
            assert max_err(c.logprobs, refs.full(step, PROBE, c.token_ids)) < TOL
        # Rank 0 wrote the gathered checkpoint: exactly the published weights.
        assert checkpoint.complete_steps(run_dir) == [2, 3]
        saved = load_safetensors_dir(checkpoint.checkpoint_dir(run_dir, 3))
        assert all(torch.equal(saved[k], v) for k, v in published.items() if k in saved)
    finally:
        await trainer.stop()  # Stop over the link: every rank exits 0 with it
    assert trainer.process.returncode == 0, _tail(run_dir)

    # A new torchrun trainer resumes from it (model and Adam state broadcast from rank 0).
    # Its orchestrator (a stand-in process named by --orchestrator-pid) then dies without a Stop.
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # noqa: ASYNC220
    trainer = TrainerProcess(config, run_dir, str(tiny_model_dir), resume=True)
    trainer.orchestrator_pid = stand_in.pid
    try:
        ready = await trainer.start()
        assert (ready.step, ready.version, ready.resumed) == (3, 3, True), ready
        samples = await _batch(fleet, 4)
        await trainer.link.send(Batch(step=4, samples=samples))
        published = _check_step(await trainer.link.recv(300), ref.step(samples, 4), run_dir, 4)
        _assert_close_weights(published, ref.state())
        # Step 5 on step 4's samples (one version old): kl_target moves the rate, and every rank
        # paces the step from the whole batch as one process does (the same rate, the same weights).
        await trainer.link.send(Batch(step=5, samples=samples))
        done, expected = await trainer.link.recv(300), ref.step(samples, 5)
        assert isinstance(done, StepDone), f"{done}\n{_tail(run_dir)}"
        assert expected.metrics["lr"] < config.trainer.lr, expected.metrics
        assert done.metrics["lr"] == pytest.approx(expected.metrics["lr"], rel=1e-6)
        assert done.metrics["kl_per_step"] == pytest.approx(expected.metrics["kl_per_step"], rel=1e-3)
        _assert_close_weights(_published(run_dir, 5), ref.state())
        # Rank 0 sees it gone on its next idle poll and tells rank 1; both exit 1, the agent with
        # them: no rank is left behind.
        ranks = [pid for pid in descendants(trainer.process.pid) if "-m orchestrator.trainer.process" in _cmdline(pid)]
        assert ready.pid in ranks and len(ranks) == 2, (ranks, ready.pid)
        stand_in.kill()
        stand_in.wait()
        with anyio.fail_after(120):  # a bound against a hang, not a speed: one idle poll is 1 s
            while trainer.alive or not all(_gone(pid) for pid in ranks):
                await anyio.sleep(0.1)
        log = (run_dir / "trainer.log").read_text(errors="replace")
        assert log.count('"trainer.orphaned"') == 2, _tail(run_dir)  # rank 0 saw it, rank 1 was told
    finally:
        stand_in.kill()
        stand_in.wait()
        await trainer.stop()
    assert trainer.process.returncode not in (0, None), _tail(run_dir)


def test_the_launcher_starts_torchrun_with_world_size_ranks_and_its_own_flags(tmp_path):
    from orchestrator.errors import ConfigError
    from orchestrator.trainer.launcher import trainer_command

    one = trainer_command(TrainerConfig(), "tcp://127.0.0.1:1", tmp_path, "m", "{}", resume=False)
    assert one[1:3] == ["-m", "orchestrator.trainer.process"]
    two = trainer_command(TrainerConfig(world_size=2), "tcp://127.0.0.1:1", tmp_path, "m", "{}", resume=True)
    assert two[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=2"]
    assert "--master-addr=127.0.0.1" in two and two[-1] == "--resume"
    assert two[two.index("-m", 2) + 1] == "orchestrator.trainer.process"
    hosts = TrainerConfig(world_size=4, torchrun_args=["--nnodes=2", "--node-rank=0", "--master-addr=10.0.0.1",
                                                      "--master-port=29500"])
    cmd = trainer_command(hosts.validate(), "tcp://127.0.0.1:1", tmp_path, "m", "{}", resume=False)
    assert "--master-addr=127.0.0.1" not in cmd and "--nnodes=2" in cmd and "--nproc-per-node=4" in cmd
    assert TrainerConfig(torchrun_args=["--max_restarts=0"]).validate().torchrun  # no restart: allowed
    for bad, field in ((TrainerConfig(world_size=0), "trainer.world_size"),
                       (TrainerConfig(torchrun_args=["--nproc_per_node=3"]), "trainer.torchrun_args[0]"),
                       (TrainerConfig(torchrun_args=["--nnodes=1", "--max-restarts=2"]), "trainer.torchrun_args[1]"),
                       (TrainerConfig(torchrun_args=["--nnodes=2", "--node_rank=1", "--master-addr=h"]),
                        "trainer.torchrun_args[1]"),
                       (TrainerConfig(torchrun_args=["--nnodes=2", "--node-rank=0"]), "trainer.torchrun_args"),
                       (TrainerConfig(bucket_bytes=0), "trainer.bucket_bytes")):
        with pytest.raises(ConfigError) as err:
            bad.validate()
        assert err.value.field == field


def test_a_rank_started_with_another_configuration_is_refused(monkeypatch):
    """A host started with another --config-json (or model) would gather shards in another order:
    the ranks compare a digest of both at start-up (here rank 1's answer is injected)."""
    import torch.distributed as dist

    from orchestrator.trainer.process import Ranks, Trainer

    trainer = Trainer.__new__(Trainer)
    trainer.config, trainer.ranks = _config(world_size=2), Ranks(rank=0, world=2)
    trainer.publisher = type("P", (), {"plan_json": "{}"})()

    def gather(out, obj):
        out[:] = [obj, "another digest"]

    monkeypatch.setattr(dist, "all_gather_object", gather)
    with pytest.raises(RuntimeError, match=r"ranks \[1\] were started with another --config-json or --model"):
        trainer._check_same_run()
    monkeypatch.setattr(dist, "all_gather_object", lambda out, obj: out.__setitem__(slice(None), [obj, obj]))
    trainer._check_same_run()


async def test_a_trainer_that_exits_before_ready_fails_the_start_at_once(tmp_path):
    """torchrun refuses its own flag and exits without a rank, so no message ever comes: the
    launcher reports the exit, not a start-up timeout (60 s here, far from reached)."""
    from orchestrator.trainer.launcher import TrainerError, TrainerProcess

    config = RunConfig(trainer=TrainerConfig(world_size=2, start_timeout_s=60.0,
                                             torchrun_args=["--nnodes=not-a-number", "--master-addr=127.0.0.1"])
                       ).validate()
    trainer = TrainerProcess(config, tmp_path, "no-model", resume=False)
    try:
        with pytest.raises(TrainerError, match=r"the trainer exited \(code [1-9]\d*\) before it reported ready"):
            await trainer.start()
    finally:
        await trainer.stop()


def test_a_sharded_checkpoints_optimizer_state_round_trips_to_a_single_process_one():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(input_ids=torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    by_index = optimizer.state_dict()
    by_name = checkpoint._by_name(model, by_index)
    assert "model.embed_tokens.weight" in by_name["state"]
    back = checkpoint._by_index(model, by_name)
    assert back["param_groups"] == by_index["param_groups"]
    for i, state in by_index["state"].items():
        assert all(torch.equal(state[k], back["state"][i][k]) for k in state)
    with pytest.raises(checkpoint.CheckpointError, match="nope"):
        checkpoint._by_index(model, {"state": {"nope": {}}, "param_groups": []})


def test_a_gathered_checkpoint_resumes_in_one_process(tmp_path):
    """docs/trainer.md: "a checkpoint resumes at any world size, one process included": the
    files `save_full` writes (FSDP2, here over a gloo group of one) load into a plain model and
    optimizer with `load`, weights and Adam state equal to the sharded ones."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    torch.manual_seed(0)
    sharded, plain = Qwen2ForCausalLM(cfg), Qwen2ForCausalLM(cfg)  # different weights
    meta = checkpoint.CheckpointMeta(step=1, version=1, created_unix=0.0, consumption=checkpoint.Consumption(
        rollout_ids=[1], advantages=[0.5], log_ratio_mean=[None], log_ratio_max_abs=[None], reward_mean=1.0,
        loss=0.25, metrics={}))
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for layer in sharded.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        optimizer = torch.optim.Adam(sharded.parameters(), lr=1e-3)
        sharded(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
        optimizer.step()
        assert checkpoint.save_full(tmp_path, sharded, optimizer, meta, keep=2, rank=0) is not None
        weights = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
        adam = {name: {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in optimizer.state[p].items()}
                for name, p in sharded.named_parameters()}
    finally:
        dist.destroy_process_group()
    plain_optimizer = torch.optim.Adam(plain.parameters(), lr=1e-3)
    assert checkpoint.load(tmp_path, 1, plain, plain_optimizer) == meta
    assert all(torch.equal(plain.state_dict()[k], v) for k, v in weights.items())
    for name, p in plain.named_parameters():
        assert adam[name].keys() == plain_optimizer.state[p].keys(), name
        assert all(torch.equal(plain_optimizer.state[p][k], v) for k, v in adam[name].items()), name


# Interpreter and allocator noise on top of what a publish holds (a thread, Python objects;
# measured: under 0.1 MiB once the gloo pair is connected). The model is 44 MB, the bound 12 MiB.
NOISE = 256 << 10


@pytest.mark.timeout(300)
async def test_each_ranks_resident_memory_while_publishing_stays_within_two_buckets_and_the_largest_tensor(
        tmp_path):
    """The resident-memory high-water mark of each torchrun rank over each publish, on a model
    large enough for the bound to be far below the model (a whole-model gather would break it,
    and so would gloo's all-gather, which holds two copies of the largest tensor)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from orchestrator.trainer.launcher import TrainerProcess

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=2048, hidden_size=512, intermediate_size=1024,
                                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                                         tie_word_embeddings=False))
    model_dir = tmp_path / "model"
    model.save_pretrained(model_dir)
    model_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    largest = max(t.numel() * t.element_size() for t in model.state_dict().values())
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    config = RunConfig(trainer=TrainerConfig(threads=1, world_size=2, bucket_bytes=4 << 20, checkpoint=False),
                       transport=TransportConfig(keep_last=2)).validate()
    rng = np.random.default_rng(0)
    trainer = TrainerProcess(config, run_dir, str(model_dir), resume=False)
    try:
        ready = await trainer.start()
        for step in (1, 2):
            samples = [Sample(rollout_id=10 * step + j, group_id=step, prompt_token_ids=pack_i32(rng.integers(3, 2000, 6)),
                              completion_token_ids=pack_i32(rng.integers(3, 2000, 4)), logprobs=pack_f32([-7.0] * 4),
                              reward=float(j), dispatched_version=step - 1) for j in range(4 if step == 1 else 1)]
            # Step 2 has one sample: rank 1 gets none and runs the zero loss FSDP's collectives need.
            await trainer.link.send(Batch(step=step, samples=samples))
            done = await trainer.link.recv(240)
            assert isinstance(done, StepDone) and done.version == step, f"{done}\n{_tail(run_dir)}"
            assert len(unpack_f32(done.log_ratio_mean)) == len(samples) and np.isfinite(done.loss)
            bound = done.metrics["publish_bound_bytes"]
            print("publish memory", step, {k: int(v) for k, v in done.metrics.items() if k.startswith("publish_")})
            assert bound == 2 * (4 << 20) + largest and 3 * bound < model_bytes
            for rank in (0, 1):
                rss = done.metrics[f"publish_rss_extra_bytes_rank{rank}"]
                counted = done.metrics[f"publish_counted_bytes_rank{rank}"]
                assert rss <= bound + NOISE, (step, rank, rss, bound)
                assert counted <= bound, (step, rank, counted, bound)
            assert done.metrics["publish_gathered_peak_bytes_rank0"] == largest  # one tensor at a time
        assert _published(run_dir, 2).keys() == model.state_dict().keys()
        # Killed, as a trainer that does not stop in time is (the Stop path is the first test's):
        # the agent and every rank, though torchrun starts each rank in a session of its own.
        agent = trainer.process.pid
        ranks = [pid for pid in descendants(agent) if "-m orchestrator.trainer.process" in _cmdline(pid)]
        assert ready.pid in ranks and len(ranks) == 2, (ranks, ready.pid)
        assert all(os.getpgid(pid) != os.getpgid(agent) for pid in ranks)  # killpg(agent) alone misses them
        trainer.kill()
        await anyio.to_thread.run_sync(trainer.process.wait)
        with anyio.fail_after(30):  # SIGKILL: gone at once; the bound only keeps a failure from hanging
            while not all(_gone(pid) for pid in ranks):
                await anyio.sleep(0.05)
    finally:
        await trainer.stop()
    assert trainer.process.returncode == -signal.SIGKILL, _tail(run_dir)


def _lora_samples(step: int) -> list[Sample]:
    """Random tokens; recorded logprobs near the tiny model's (vocabulary 1024: about -6.9);
    rewards varied within each group."""
    rng = np.random.default_rng(step)
    return [Sample(rollout_id=100 * step + j, group_id=10 * step + j // GROUP_SIZE,
                   prompt_token_ids=pack_i32(rng.integers(3, 1000, int(rng.integers(3, 8)))),
                   completion_token_ids=pack_i32(rng.integers(3, 1000, 4)),
                   logprobs=pack_f32(rng.normal(-7.0, 0.3, 4).tolist()), reward=float(rng.random()),
                   dispatched_version=step - 1) for j in range(GROUPS * GROUP_SIZE)]


def _same_adapter_step(done, expected, run_dir: Path, ref_dir: Path, step: int) -> None:
    """The torchrun step is the single-process one: its statistics, and its published (and
    checkpointed) adapter within 1e-5 of the single-process trainer's."""
    from safetensors.torch import load_file

    assert isinstance(done, StepDone), f"{done}\n{_tail(run_dir)}"
    assert (done.step, done.version) == (step, step)
    assert done.loss == pytest.approx(expected.loss, rel=1e-4, abs=1e-6)
    assert done.metrics["grad_norm"] == pytest.approx(expected.metrics["grad_norm"], rel=1e-4)
    ours, theirs = adapter_dir(run_dir / "weights", step), adapter_dir(ref_dir / "weights", step)
    assert check_adapter(ours)["tensors"] == check_adapter(theirs)["tensors"] > 0
    assert (ours / ADAPTER_CONFIG).read_text() == (theirs / ADAPTER_CONFIG).read_text()
    published, reference = load_file(ours / ADAPTER_MODEL), load_file(theirs / ADAPTER_MODEL)
    assert published.keys() == reference.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(published[name], tensor, atol=1e-5, rtol=0, msg=name)
    # Rank 0's gathered checkpoint holds the adapter alone: exactly the published tensors.
    saved = load_file(checkpoint.checkpoint_dir(run_dir, step) / checkpoint.MODEL_FILE)
    assert saved.keys() == published.keys() and all(torch.equal(saved[k], v) for k, v in published.items())
    assert checkpoint.read_meta(run_dir, step).lora is True


@pytest.mark.timeout(600)
async def test_a_lora_fsdp_step_publishes_the_single_process_adapter_and_resumes(tiny_model_dir, tmp_path):
    """trainer.lora under torchrun (2 gloo ranks): the model is wrapped with the adapter before
    it is sharded; each step publishes the adapter a single-process trainer publishes on the
    same batch (1e-5), and a torchrun trainer resumed from the gathered checkpoint (adapter and
    Adam state broadcast from rank 0) takes the next step as the single-process one does."""
    from orchestrator.trainer.launcher import TrainerProcess
    from orchestrator.trainer.process import Trainer

    config = RunConfig(trainer=TrainerConfig(threads=1, world_size=2, lora=LoraConfig(rank=4, alpha=8.0)),
                       transport=TransportConfig(keep_last=8)).validate()
    single = msgspec.structs.replace(config, trainer=msgspec.structs.replace(config.trainer, world_size=1))
    ref_dir, run_dir = tmp_path / "single", tmp_path / "run"
    run_dir.mkdir()
    ref = Trainer(str(ref_dir), str(tiny_model_dir), single)
    ref.start(resume=False)
    try:
        for step in (1, 2):
            trainer = TrainerProcess(config, run_dir, str(tiny_model_dir), resume=step > 1)
            try:
                ready = await trainer.start()
                # No refit plan with an adapter: plan_json is empty.
                assert (ready.plan_json, ready.step, ready.resumed) == ("", step - 1, step > 1), ready
                samples = _lora_samples(step)
                await trainer.link.send(Batch(step=step, samples=samples))
                done = await trainer.link.recv(300)
                _same_adapter_step(done, ref.handle(Batch(step=step, samples=samples)), run_dir, ref_dir, step)
            finally:
                await trainer.stop()  # Stop over the link: every rank exits 0 with it
            assert trainer.process.returncode == 0, _tail(run_dir)
    finally:
        ref.close()


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    """Exited: no such process, or a zombie (its parent, the agent, was killed before reaping it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True
