"""`[cluster]` as configuration: what it decides, what it refuses by name, and the trainer's rendezvous
flags it derives (the multi-host runs themselves: tests/cluster/)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from orchestrator.config.run import RunConfig, convert
from orchestrator.errors import ConfigError
from orchestrator.trainer.launcher import OWNER_PID, Rendezvous, TrainerProcess

CLUSTER = {"address": "10.213.0.1:6379", "engines": {"count": 3}}


def config(**tables) -> RunConfig:
    return convert({"cluster": CLUSTER, **tables}, RunConfig, "").validate()


def refused(field: str, **tables) -> str:
    with pytest.raises(ConfigError) as info:
        config(**tables)
    assert info.value.field == field, info.value
    return info.value.reason


def test_every_engine_is_a_server_that_ray_places_with_its_own_seed():
    engines = config().engine_configs()
    assert [e for e, _ in engines] == ["engine-0", "engine-1", "engine-2"]
    assert {c.kind for _, c in engines} == {"server"} and [c.seed for _, c in engines] == [0, 1, 2]
    assert all(c.worker_extension_cls == "transports.swap.SwapWorkerExtension" for _, c in engines)


def test_what_cluster_does_not_carry_is_refused_by_name():
    with pytest.raises(ConfigError) as info:
        convert({"cluster": {"engines": {"count": 1}}}, RunConfig, "").validate()
    assert info.value.field == "cluster.address"
    assert "cluster.engines.count" in refused("engines", engines=2)
    assert "placed" in refused("engine.url", engine={"kind": "server", "url": "http://127.0.0.1:8000"})
    assert "pull" in refused("http.enabled", http={"enabled": False})
    assert "other hosts" in refused("trainer.lora", trainer={"lora": {"rank": 8}})
    with pytest.raises(ConfigError) as info:
        convert({"cluster": {**CLUSTER, "engines": {"cnt": 2}}}, RunConfig, "")
    assert info.value.field == "cluster.engines.cnt"
    with pytest.raises(ConfigError) as info:
        convert({"cluster": {**CLUSTER, "unreachable_s": 0}}, RunConfig, "").validate()
    assert info.value.field == "cluster.unreachable_s"
    with pytest.raises(ConfigError) as info:
        convert({"cluster": {**CLUSTER, "engines": {"count": 3, "max_count": 2}}}, RunConfig, "").validate()
    assert info.value.field == "cluster.engines.max_count" and "cluster.engines.count (3)" in info.value.reason


def test_max_count_lets_the_fleet_grow_past_count_and_defaults_to_count():
    engines = config().cluster.engines
    assert engines.max_count is None and engines.most == 3
    grown = convert({"cluster": {**CLUSTER, "engines": {"count": 2, "max_count": 5}}}, RunConfig, "").validate()
    assert grown.cluster.engines.most == 5 and len(grown.engine_configs()) == 2  # starts with count


def test_a_trainer_over_several_hosts_refuses_what_only_one_process_can_do():
    two = {"address": "10.213.0.1:6379", "trainer": {"nodes": 2}}
    for trainer, field in (({"torchrun_args": ["--nnodes=2"]}, "trainer.torchrun_args"),
                           ({"checkpoint_every": 2}, "trainer.checkpoint_every"),
                           ({"checkpoint_background": True}, "trainer.checkpoint_background")):
        with pytest.raises(ConfigError) as info:
            convert({"cluster": two, "trainer": trainer}, RunConfig, "").validate()
        assert info.value.field == field


def test_node_0_and_the_other_nodes_run_one_torchrun_at_one_rendezvous(tmp_path):
    run = convert({"cluster": {"address": "10.213.0.1:6379", "trainer": {"nodes": 2}},
                   "trainer": {"world_size": 2}}, RunConfig, "").validate()
    rendezvous = Rendezvous(nnodes=2, addr="10.213.0.1", port=29555)
    trainer = TrainerProcess(run, Path(tmp_path), "/models/m", resume=False, rendezvous=rendezvous)
    # the trainer's own configuration: the rendezvous as torchrun flags, no [cluster] (which it never reads)
    assert trainer.config.cluster is None and trainer.config.trainer.torchrun
    assert trainer.config.trainer.torchrun_args == ["--nnodes=2", "--node-rank=0", "--master-addr=10.213.0.1",
                                                    "--master-port=29555"]
    assert not trainer.config.trainer.background_checkpoints  # the ranks gather each checkpoint
    argv = trainer.node_command(1)
    assert "--node-rank=1" in argv and "--node-rank=0" not in argv and "--nproc-per-node=2" in argv
    assert "--master-addr=10.213.0.1" in argv and "--master-port=29555" in argv
    assert argv[argv.index("--orchestrator-pid") + 1] == OWNER_PID
    # every node validates the same configuration (node 0's), and its digest must match node 0's
    sent = msgspec.json.decode(argv[argv.index("--config-json") + 1].encode(), type=RunConfig).validate()
    assert sent == trainer.config
    assert json.loads(argv[argv.index("--config-json") + 1])["trainer"]["torchrun_args"][1] == "--node-rank=0"


def test_the_run_listens_and_joins_at_one_address_of_this_host():
    """The node's address is worked out once: the HTTP server listens there instead of on loopback
    (other hosts pull versions from it), engine workers are sent there, Ray is told it."""
    from orchestrator.run.cluster import ClusterSide

    named = convert({"cluster": {**CLUSTER, "node_ip": "10.213.0.2"}}, RunConfig, "").validate().cluster
    side = ClusterSide(named, "run-a")
    assert [side.http_host(h) for h in ("127.0.0.1", "localhost", "::1")] == ["10.213.0.2"] * 3
    assert side.http_host("0.0.0.0") == "0.0.0.0"  # every address: the configured host stands
    assert side.pull("http://0.0.0.0:8123")["url"] == "http://10.213.0.2:8123"
    assert side.placement.node_ip == "10.213.0.2"
    # unnamed: this host's address on the route to the Ray head (loopback here: nothing is sent)
    routed = ClusterSide(convert({"cluster": {"address": "127.0.0.1:6379"}}, RunConfig, "").validate().cluster, "b")
    assert routed.node_ip == routed.placement.node_ip == routed.http_host("127.0.0.1") == "127.0.0.1"
    routed.placement.close()  # never joined: nothing to leave, whether or not Ray is installed
