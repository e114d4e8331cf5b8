"""The worker-side stager (`transports.swap.SwapWorkerExtension`) without a vLLM engine: the
extension object over a fake `model_runner` holding a small torch model; vLLM's layerwise
reload is replaced by a plain copy (on CPU the real one repacks linear layers; that path runs
in the engine tests). What is tested here is the stager's own logic:

* only a *committed* filesystem version is reported staged (issue 11, item 6), and a request
  without an attempt stages the committed one;
* two staging threads never write one shadow (issue 11, item 2): after a drop, a re-stage
  waits for (or refuses while) the old thread, and the flipped weights are exactly one version.
"""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import tiny_model, tiny_plan, tiny_state
from transports.errors import TransportError, TransportTimeoutError
from transports.factory import create_weight_synchronizer
from transports.filesystem import FilesystemReceiver, FilesystemSender
from transports.refit.plan import RefitPlan
from transports.staging import StagingArea

version_state = tiny_state
make_plan = tiny_plan


def publish(root, plan: RefitPlan, version: int, state, attempt: int, commit: bool = True) -> FilesystemSender:
    sender = FilesystemSender(root, keep_last=50, fsync=False)
    sender.begin(version, plan.bucket_count)
    for header, payload in plan.pack(state, version=version, attempt=attempt, prefetch=False):
        sender.send(header, payload)
    if commit:
        sender.commit(version)
    return sender


def synchronizer(root, state):
    """The project's own trainer side: publishes attempt 1 and up."""
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[], colocated=False, transport="filesystem",
                                      filesystem_root=root, plan=make_plan())
    sync.init_communicator()
    return sync


# -- the receiver path the stager uses -------------------------------------------------------


def test_a_synchronizer_publish_is_staged_as_its_committed_attempt(tmp_path):
    state = version_state(1)
    sync = synchronizer(tmp_path, state)
    sync.mark_stale()
    assert sync.sync_weights() == 1
    plan = sync.plan
    receiver = FilesystemReceiver(tmp_path, arena_bytes=plan.arena_bytes, timeout_s=2)
    attempt = receiver.committed_attempt(1)
    assert attempt >= 1  # not the 0 a request without an attempt used to wait for
    staging = StagingArea(plan)
    staging.begin(1, attempt)
    receiver.receive(1, staging, committed=True)
    got = staging.finish()
    assert all(torch.equal(got[k], state[k]) for k in state)
    sync.shutdown()


def test_an_uncommitted_version_is_never_reported_received(tmp_path):
    plan = make_plan()
    sender = publish(tmp_path, plan, 3, version_state(3), attempt=1, commit=False)  # every bucket, no COMPLETE
    receiver = FilesystemReceiver(tmp_path, arena_bytes=plan.arena_bytes, timeout_s=0.5)
    staging = StagingArea(plan)
    staging.begin(3, 1)
    with pytest.raises(TransportTimeoutError, match="version 3 to be committed"):
        receiver.receive(3, staging, committed=True)
    with pytest.raises(TransportTimeoutError, match="committed"):
        receiver.committed_attempt(3)
    sender.close()


def test_buckets_of_an_attempt_replaced_before_the_commit_are_refused(tmp_path):
    plan = make_plan()
    assert plan.bucket_count > 1
    publish(tmp_path, plan, 4, version_state(4), attempt=1, commit=False).close()
    receiver = FilesystemReceiver(tmp_path, arena_bytes=plan.arena_bytes, timeout_s=3)
    staging = StagingArea(plan)
    staging.begin(4, 1)
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            receiver.receive(4, staging, committed=True)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=receive)
    thread.start()
    time.sleep(0.3)  # attempt 1 is read (from the directory being written); its commit never comes
    publish(tmp_path, plan, 4, version_state(44), attempt=2)  # the retry is what gets committed
    thread.join(10)
    assert not thread.is_alive()
    assert errors and isinstance(errors[0], TransportError)


# -- the extension over a fake model runner ---------------------------------------------------


@pytest.fixture
def swap(monkeypatch):
    import transports.swap as swap_module

    gates: dict[str, threading.Event] = {}

    def reload_into(model, weights, model_config):
        gate = gates.get(threading.current_thread().name)
        params = dict(model.named_parameters())
        for i, (name, tensor) in enumerate(sorted(weights.items())):
            if gate is not None and i == 1:
                gate.wait(10)  # half of this version written into the model, then a stall
            params[name].data.copy_(tensor)

    monkeypatch.setattr(swap_module, "reload_into", reload_into)
    monkeypatch.setattr(swap_module, "share_reload_metadata", lambda live, shadow: None)
    swap_module.gates = gates
    return swap_module


def extension(swap_module, root, plan: RefitPlan, **cfg):
    torch.manual_seed(0)
    model = tiny_model()
    ext = swap_module.SwapWorkerExtension()
    ext.model_runner = SimpleNamespace(get_model=lambda: model, model_config=SimpleNamespace(dtype=torch.float32),
                                       requests={})
    ext.swap_init(json.dumps({"plan": plan.encode().decode(), "root": str(root), "strategy": "double_buffer",
                              "timeout_s": 5, **cfg}))
    return ext, model


def wait_state(ext, *states: str, timeout_s: float = 10) -> dict:
    deadline = time.monotonic() + timeout_s
    while (status := ext.swap_status())["state"] not in states:
        assert time.monotonic() < deadline, status
        time.sleep(0.01)
    return status


def live_equals(model, state) -> bool:
    return all(torch.equal(model.state_dict()[k], state[k]) for k in state)


def staged_extension(swap_module, root, state):
    """Version 1 (`state`) published by a synchronizer, and an extension that staged it."""
    sync = synchronizer(root, state)
    sync.mark_stale()
    sync.sync_weights()
    ext, model = extension(swap_module, root, sync.plan)
    ext.swap_stage(json.dumps({"version": 1}))  # what the orchestrator's Fleet sends
    status = wait_state(ext, "staged", "failed")
    assert status["state"] == "staged", status
    return sync, ext, model, status


def test_a_stage_without_attempt_stages_the_committed_version(swap, tmp_path):
    state = version_state(1)
    sync, ext, model, status = staged_extension(swap, tmp_path, state)
    assert status["attempt"] >= 1
    ext.swap_apply()
    assert live_equals(model, state)
    sync.shutdown()


def test_a_version_whose_commit_never_happens_is_not_staged(swap, tmp_path):
    plan = make_plan()
    sender = publish(tmp_path, plan, 2, version_state(2), attempt=1, commit=False)
    ext, model = extension(swap, tmp_path, plan, timeout_s=0.5)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ext.swap_stage(json.dumps({"version": 2, "attempt": 1}))
    status = wait_state(ext, "staged", "failed")
    assert status["state"] == "failed" and "committed" in status["error"]
    with pytest.raises(RuntimeError, match="nothing staged"):
        ext.swap_apply()
    assert live_equals(model, before)
    sender.close()


def test_a_slow_stage_dropped_then_restaged_flips_exactly_one_version(swap, tmp_path):
    plan = make_plan()
    v1, v2 = version_state(1), version_state(2)
    publish(tmp_path, plan, 1, v1, attempt=1)
    publish(tmp_path, plan, 2, v2, attempt=1)
    ext, model = extension(swap, tmp_path, plan, stage_delay_s=1.0)
    ext.swap_stage(json.dumps({"version": 1, "attempt": 1}))
    old = ext._swap()["stager"].thread
    time.sleep(0.1)
    ext.swap_drop()
    ext._swap()["cfg"]["stage_delay_s"] = 0.0
    ext.swap_stage(json.dumps({"version": 2, "attempt": 1}))
    assert wait_state(ext, "staged", "failed")["state"] == "staged"
    old.join(5)  # whatever the old thread would still do, it has done it
    assert ext.swap_apply()["version"] == 2
    assert live_equals(model, v2)


def test_a_restage_is_refused_while_the_dropped_thread_still_writes_the_shadow(swap, tmp_path):
    plan = make_plan()
    v1, v2 = version_state(1), version_state(2)
    publish(tmp_path, plan, 1, v1, attempt=1)
    publish(tmp_path, plan, 2, v2, attempt=1)
    ext, model = extension(swap, tmp_path, plan, join_s=0.2)
    gate = swap.gates["inflight-stage-1"] = threading.Event()
    ext.swap_stage(json.dumps({"version": 1, "attempt": 1}))
    old = ext._swap()["stager"].thread
    deadline = time.monotonic() + 10
    while not any(torch.equal(p, v1[n]) for n, p in ext._swap()["shadow"].named_parameters()
                  ) if ext._swap()["shadow"] is not None else True:
        assert time.monotonic() < deadline
        time.sleep(0.01)  # the old thread is half-way through writing the shadow
    ext.swap_drop()
    with pytest.raises(RuntimeError, match="previous staging still running"):
        ext.swap_stage(json.dumps({"version": 2, "attempt": 1}))
    gate.set()
    old.join(5)
    assert ext.swap_status()["state"] == "idle"  # the dropped thread discarded its result
    ext.swap_stage(json.dumps({"version": 2, "attempt": 1}))
    assert wait_state(ext, "staged", "failed")["state"] == "staged"
    ext.swap_apply()
    assert live_equals(model, v2)


def test_a_late_drop_of_another_version_answers_instead_of_deadlocking(swap, tmp_path):
    sync, ext, model, _status = staged_extension(swap, tmp_path, version_state(1))
    ext.swap_apply()
    # A failed activation of version 2 drops it everywhere; this worker holds version 1 in its
    # stager (idle): the drop must leave it alone and answer (a deadlock here froze the engine).
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(ext.swap_drop("2")), daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive(), "swap_drop deadlocked"
    assert result["version"] == 1
    sync.shutdown()


def test_the_pause_free_watch_reports_new_requests_and_their_prefix_cache_hits(swap, tmp_path):
    sync, ext, _model, _status = staged_extension(swap, tmp_path, version_state(1))
    steps = []
    ext.model_runner.execute_model = lambda scheduler_output: steps.append(scheduler_output)
    ext.swap_apply(json.dumps({"watch": True}))
    new = [SimpleNamespace(req_id="a-1", num_computed_tokens=0), SimpleNamespace(req_id="b-2", num_computed_tokens=16)]
    ext.model_runner.execute_model(SimpleNamespace(scheduled_new_reqs=new))
    # a request seen again (resumed) keeps what its first scheduling reported
    ext.model_runner.execute_model(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="b-2", num_computed_tokens=0)]))
    assert len(steps) == 2  # the real step still ran
    assert ext.swap_confirm() == {"requests": {"a-1": 0, "b-2": 0}, "cached": {"b-2": 16}}
    ext.model_runner.execute_model(SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id="c-3", num_computed_tokens=0)]))
    assert ext.swap_confirm() == {"requests": {}, "cached": {}}  # the watch ended with the confirm
    sync.shutdown()


def test_the_rotary_reload_notice_is_dropped_and_other_reload_warnings_kept():
    import logging

    import transports.swap  # noqa: F401 - installs the filter, as in every engine worker

    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep()
    logger.addHandler(handler)
    try:
        logger.warning("%s: Failed to load weights", "RotaryEmbedding")
        logger.warning("%s: Failed to load weights", "QKVParallelLinear")
    finally:
        logger.removeHandler(handler)
    assert seen == ["QKVParallelLinear: Failed to load weights"]
