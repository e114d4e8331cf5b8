"""`inflight run` over five hosts (network namespaces joined by a real Ray cluster), and the faults of a
multi-host run, each asserted by its own test over one shared scenario (one engine start per phase is
what a CPU affords):

  host 0: the orchestrator, the Ray head, trainer node 0 (rank 0: the link, the run directory)
  host 1, host 2: one vLLM server engine each (Ray resource "engine")
  host 3: trainer node 1 (Ray resource "trainer"): FSDP2 over gloo across hosts 0 and 3
  host 4: joins the Ray cluster only mid-run, offering the engine resource (the fleet grows onto it)
  (each host's engine binds a core of its own: `host_env`)

The scenario, in order (the run has `fleet.replace = true`): four steps; host 2's link cut (its engine
fenced, the run goes on) and restored (the engine rejoins at the live version, then serves; a cut link
is not a loss, nothing is replaced); host 1 killed (Ray's node death: the engine is lost, the run goes on
with one); host 1 back, its Ray node joins offering the engine resource: Ray places the lost engine's
bundle there and the run starts a replacement in it; while that one starts, host 4's node joins with
nothing else lost: the fleet (`count = 2, max_count = 3`) grows onto it, both new engines starting side by
side and joining at the live version, then serving; host 3 killed (the trainer node: the run stops, one
named line, exit 2); host 4 gone with it (no room for growth from here on); host 3 back, `--resume`
(continues exactly once); the orchestrator SIGKILLed mid-run (within 30 s nothing of the run is left on
any host, its placement groups released, the pending growth group among them); `--resume` to the end.
Counted from outside, on the replay log: no rollout id twice, every dispatched rollout one terminal
record, every step consumed once, no version applied by part of the fleet.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from orchestrator.bench.ray_hosts import BIN, ClusterRun, consumed_steps, host_env, run_leftovers, write_cluster_config
from replay.log import read_records
from replay.records import ActivationRecord, RolloutRecord
from tests.cluster.cluster_helpers import make_hosts, start_cluster

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.timeout(2400)]
INFLIGHT = [sys.executable, "-m", "orchestrator.commands.cli"]
ENGINE, TRAINER = {"engine": 1}, {"trainer": 1}
FIRST_STEPS = 4  # before the first fault: each later phase waits for steps of its own


class Scenario:
    def __init__(self) -> None:
        self.facts: dict = {}
        self.errors: dict[str, str] = {}
        self.seconds: dict[str, float] = {}  # each phase's wall time (printed with -s)

    def phase(self, name: str):
        scenario = self

        class Phase:
            def __enter__(self):
                self.started = time.monotonic()
                return self

            def __exit__(self, kind, exc, tb):
                scenario.seconds[name] = round(time.monotonic() - self.started, 1)
                if exc is not None and not isinstance(exc, KeyboardInterrupt):
                    import traceback

                    scenario.errors[name] = "".join(traceback.format_exception(kind, exc, tb))[-6000:]
                    return True
                return False

        return Phase()

    def need(self, *names: str) -> None:
        for name in names:
            if name in self.errors:
                pytest.fail(f"phase {name} failed:\n{self.errors[name]}")
            if name not in self.facts:
                pytest.fail(f"phase {name} did not run (an earlier phase failed: {sorted(self.errors)})")


def placement_groups(hosts, address: str) -> dict:
    code = ("import json, ray; ray.init(address=%r, log_to_driver=False, _node_ip_address=%r); "
            "from ray.util import placement_group_table; "
            "print(json.dumps({k: v['state'] for k, v in placement_group_table().items()}))"
            % (address, hosts[0].address))
    out = hosts[0].run([str(BIN / "python"), "-c", code], env=host_env(hosts[0]), capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-2000:]
    return json.loads(out.stdout.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def scenario(tmp_path_factory, rl_model):
    base = tmp_path_factory.mktemp("cluster")
    run_dir = base / "run"
    s = Scenario()
    hosts = make_hosts(5, base, rl_model)
    ray = None
    try:
        ray = start_cluster(hosts, {1: ENGINE, 2: ENGINE, 3: TRAINER, 4: ENGINE}, later=(4,))
        config = write_cluster_config(base / "config.toml", rl_model, ray.address, engines=2, trainer_nodes=2,
                                      max_engines=3, extra="unreachable_s = 8.0\n[fleet]\nreplace = true")
        s.facts.update(hosts=hosts, run_dir=run_dir, address=ray.address)
        run = ClusterRun(hosts, config, run_dir, 400)
        with s.phase("first_steps"):
            run.wait_for_steps(FIRST_STEPS, 600, "the first steps")
            placed = {e["engine"]: e["node_ip"] for e in run.events("engine.placed")}
            s.facts["first_steps"] = {"placed": placed, "nodes": run.events("trainer.node_started")}
        with s.phase("link_cut"):
            s.need("first_steps")
            cut_engine = next(e for e, ip in placed.items() if ip == hosts[2].address)
            cut_at = time.time()
            hosts[2].cut()
            fenced = run.wait_for(lambda: [e for e in run.events("fleet.fenced") if e["engine"] == cut_engine],
                                  120, "the cut engine fenced")
            steps_while_cut = consumed_steps(run_dir)
            run.wait_for_steps(steps_while_cut + 2, 300, "steps while the link is cut")
            steps_after_cut = consumed_steps(run_dir)
            hosts[2].restore()
            restored_at = time.time()
            rejoined = run.wait_for(lambda: [e for e in run.events("engine.rejoined") if e["engine"] == cut_engine],
                                    180, "the engine rejoined")
            rejoined_at = time.time()
            run.wait_for_steps(steps_after_cut + 2, 300, "steps after the rejoin")
            s.facts["link_cut"] = dict(engine=cut_engine, cut_at=cut_at, fenced=fenced, restored_at=restored_at,
                                       rejoined=rejoined[0], rejoined_at=rejoined_at,
                                       steps_while_cut=(steps_while_cut, steps_after_cut))
        with s.phase("engine_host_killed"):
            s.need("link_cut")
            lost_engine = next(e for e, ip in placed.items() if ip == hosts[1].address)
            before = consumed_steps(run_dir)
            hosts[1].kill()
            lost = run.wait_for(lambda: [e for e in run.events("engine.lost") if e["engine"] == lost_engine
                                         and "Ray actor died" in e["error"]], 180, "Ray's node death as an engine loss")
            run.wait_for_steps(before + 2, 300, "steps on one engine")
            s.facts["engine_host_killed"] = dict(engine=lost_engine, lost=lost[0], before=before,
                                                 after=consumed_steps(run_dir))
        with s.phase("engine_host_replaced"):
            s.need("engine_host_killed")
            started = time.monotonic()
            hosts[1].restart()
            ray.join(1)  # its Ray node joins again, offering the engine resource
            node_joined = time.monotonic()
            replacing = run.wait_for(lambda: [e for e in run.events("fleet.replacing") if e["engine"] == lost_engine],
                                     300, "the lost engine's bundle placed on the node that joined")
            # While the replacement starts, a node offering the engine resource joins with nothing
            # else lost: room past `count`, which the run asks for once the lost bundle has its node.
            grow_started = time.monotonic()
            ray.join(4)
            grow_joined = time.monotonic()
            source = f"replacement of {lost_engine}"
            joined = run.wait_for(lambda: [e for e in run.events("fleet.joined") if e["source"] == source], 300,
                                  "a replacement engine placed on the node that joined")
            serving = time.monotonic()
            new = joined[0]["engine"]
            grown = run.wait_for(lambda: [e for e in run.events("fleet.joined") if e["source"] == "growth"],
                                 300, "an engine past count on the node that joined")
            grown_serving = time.monotonic()
            run.wait_for(lambda: len(completed_on(run_dir, new)) >= 2, 300, "rollouts on the replacement")
            s.facts["engine_host_replaced"] = dict(
                engine=new, joined=joined[0], placed=[e for e in run.events("engine.placed") if e["engine"] == new],
                replacing=[e for e in run.events("fleet.replacing") if e["replacement"] == new],
                seconds=dict(node_join=node_joined - started, to_serving=serving - node_joined,
                             to_rollouts=time.monotonic() - serving))
            new_grown = grown[0]["engine"]
            run.wait_for(lambda: len(completed_on(run_dir, new_grown)) >= 2, 300, "rollouts on the engine past count")
            s.facts["grown"] = dict(
                engine=new_grown, joined=grown[0], replacing=replacing[0], replacement_joined=joined[0],
                placed=[e for e in run.events("engine.placed") if e["engine"] == new_grown],
                growing=[e for e in run.events("fleet.growing") if e["engine"] == new_grown],
                seconds=dict(node_join=grow_joined - grow_started, to_serving=grown_serving - grow_joined))
        with s.phase("trainer_host_killed"):
            s.need("engine_host_killed")
            killed_at = time.monotonic()
            hosts[3].kill()
            code = run.wait(300)
            s.facts["trainer_host_killed"] = dict(code=code, seconds=time.monotonic() - killed_at,
                                                  output=run.output(), steps=consumed_steps(run_dir))
            # The grown engine's host dies between runs and comes back empty, its Ray node not rejoined:
            # no room for growth from here on (the resumed runs' growth requests stay pending).
            hosts[4].restart()
        with s.phase("orchestrator_killed"):
            s.need("trainer_host_killed")
            hosts[3].restart()  # the trainer host comes back and rejoins the cluster (host 1 is back already)
            ray.join(3)
            steps = consumed_steps(run_dir)
            resumed = ClusterRun(hosts, config, run_dir, 400, "--resume")
            resumed.wait_for_steps(steps + 2, 600, "steps after --resume")
            resumed.proc.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            left = {}
            while time.monotonic() - killed_at < 30:
                left = run_leftovers(hosts)
                if not left:
                    break
                time.sleep(1)
            s.facts["orchestrator_killed"] = dict(left=left, seconds=time.monotonic() - killed_at,
                                                  resumed_from=steps, resumed_steps=consumed_steps(run_dir))
            deadline = time.monotonic() + 60
            while (groups := placement_groups(hosts, ray.address)) and time.monotonic() < deadline and \
                    any(state != "REMOVED" for state in groups.values()):
                time.sleep(2)
            s.facts["orchestrator_killed"]["groups"] = groups
        with s.phase("finished"):
            s.need("orchestrator_killed")
            final = consumed_steps(run_dir) + 2
            last = ClusterRun(hosts, config, run_dir, final, "--resume")
            code = last.wait(900)
            s.facts["finished"] = dict(code=code, steps=final, output=last.output())
        with s.phase("isolation"):
            s.facts["isolation"] = isolation(hosts, run_dir)
    finally:
        names, pids = {h.netns for h in hosts} | {hosts.switch}, [p for h in hosts if h.alive for p in h.processes()]
        scratch = hosts.scratch_base
        hosts.close()
        if ray is not None:
            ray.close()
        listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
        s.facts["cleanup"] = dict(namespaces=sorted(names & set(listed)),
                                  processes=[p for p in pids if Path(f"/proc/{p}").exists()],
                                  scratch=Path(scratch).exists())
    print(f"\nscenario phases (s): {s.seconds}; the replacement's (s): "
          f"{s.facts.get('engine_host_replaced', {}).get('seconds')}; the engine past count's (s): "
          f"{s.facts.get('grown', {}).get('seconds')}")
    yield s


def completed_on(run_dir: Path, engine: str) -> list[RolloutRecord]:
    try:
        return [r for r in read_records(run_dir) if isinstance(r, RolloutRecord) and r.engine_id == engine
                and r.status_name == "completed"]
    except Exception:  # noqa: BLE001 - the log is being written
        return []


def isolation(hosts, run_dir: Path) -> dict:
    """What the other hosts see of the run directory, and what their scratch holds."""
    out = {}
    for host in hosts[1:]:
        inside = host.run(["ls", "-A", str(run_dir.parent)], capture_output=True) if host.alive else None
        out[host.name] = dict(
            sees=inside.stdout.decode().split() if inside is not None else None,
            run_files=[str(p) for p in host.scratch.rglob("*") if p.suffix == ".seg" or p.name.startswith("step-")],
            pulled=[str(p) for p in host.scratch.rglob("v0*") if p.is_dir()])
    return out


def test_a_run_over_five_hosts_with_engines_and_trainer_ranks_placed_by_ray(scenario):
    scenario.need("first_steps", "finished")
    hosts, facts = scenario.facts["hosts"], scenario.facts
    placed = facts["first_steps"]["placed"]
    assert sorted(placed.values()) == sorted([hosts[1].address, hosts[2].address]), placed
    nodes = facts["first_steps"]["nodes"]
    assert [n["node_ip"] for n in nodes] == [hosts[3].address]
    trainer_log = (facts["run_dir"] / "trainer.log").read_text()
    assert '"world": 2' in trainer_log
    assert facts["finished"]["code"] == 0, facts["finished"]["output"][-3000:]


def test_every_engine_served_and_each_record_names_it(scenario):
    scenario.need("first_steps", "engine_host_replaced", "orchestrator_killed", "finished")
    run_dir = scenario.facts["run_dir"]
    served = {r.engine_id for r in read_records(run_dir) if isinstance(r, RolloutRecord) and r.status_name == "completed"}
    facts = scenario.facts
    assert served >= set(facts["first_steps"]["placed"]) | {facts["engine_host_replaced"]["engine"], facts["grown"]["engine"]}, \
        served
    history = [json.loads(line) for line in (run_dir / "fleet.jsonl").read_text().splitlines()]
    assert served <= {h["engine"] for h in history}, (served, history)  # every engine that served is in the fleet's log


def test_the_log_holds_exactly_once_across_every_fault_and_resume(scenario):
    scenario.need("finished")
    from tests.integration.test_run import check_log_invariants

    records = check_log_invariants(scenario.facts["run_dir"], scenario.facts["finished"]["steps"])
    for a in (r for r in records if isinstance(r, ActivationRecord)):
        outcomes = {e.outcome for e in a.engines}
        if a.outcome == "activated":  # every engine of the fleet applied it
            assert outcomes == {"activated"}, a
        elif a.outcome in ("rolled_back", "failed"):  # none serves it
            assert "activated" not in outcomes or a.outcome == "rolled_back", a


def test_stats_and_verify_spans_as_on_one_host(scenario):
    scenario.need("finished")
    run_dir = scenario.facts["run_dir"]
    stats = subprocess.run(INFLIGHT + ["stats", str(run_dir), "--json"], capture_output=True, text=True, timeout=300)
    assert stats.returncode == 0, stats.stderr
    body = json.loads(stats.stdout)
    rollouts = [r for r in read_records(run_dir) if isinstance(r, RolloutRecord)]
    assert body["rollouts"]["total"] == len(rollouts) and body["rollouts"]["completed"] > 0
    assert body["staleness"]["count"] > 0
    verified = subprocess.run(INFLIGHT + ["replay", str(run_dir), "--verify-spans", "--steps", "1:12", "--json"],
                              capture_output=True, text=True, timeout=900)
    assert verified.returncode == 0, verified.stderr[-3000:]
    report = json.loads(verified.stdout)
    assert report["verify_spans"]["passed"] and report["verify_spans_max_abs_diff"] <= 1e-3


def test_the_run_directory_exists_only_on_the_orchestrators_host(scenario):
    scenario.need("finished", "isolation")
    run_dir = scenario.facts["run_dir"]
    assert list((run_dir / "replay").glob("*.seg"))
    for name, seen in scenario.facts["isolation"].items():
        assert seen["sees"] == [], (name, seen["sees"])  # an empty tmpfs over the run's parent
        assert seen["run_files"] == [], (name, seen["run_files"])  # no replay segment, no checkpoint
    pulled = [p for seen in scenario.facts["isolation"].values() for p in seen["pulled"]]
    assert pulled, "no engine host holds a version it pulled"


def test_a_cut_link_fences_its_engine_the_run_goes_on_and_the_engine_rejoins_at_the_live_version(scenario):
    scenario.need("link_cut")
    facts = scenario.facts["link_cut"]
    engine = facts["engine"]
    while_cut, after_cut = facts["steps_while_cut"]
    assert after_cut >= while_cut + 2  # trainer steps while the engine was fenced
    rollouts = [r for r in read_records(scenario.facts["run_dir"]) if isinstance(r, RolloutRecord)]
    ended_by_cut = [r for r in rollouts if r.engine_id == engine and r.status_name != "completed"
                    and facts["cut_at"] <= r.timings.dispatched_at + 120 and r.timings.dispatched_at < facts["restored_at"]]
    assert all(r.status_name in ("errored", "dropped") for r in ended_by_cut)
    live = facts["rejoined"]["live_version"]
    later = [r for r in rollouts if r.engine_id == engine and r.timings.dispatched_at > facts["rejoined_at"]]
    assert later, "the rejoined engine served nothing"
    assert min(r.dispatched_version for r in later) >= live


def test_an_engine_host_killed_is_a_node_death_and_the_run_goes_on_with_fewer(scenario):
    scenario.need("engine_host_killed")
    facts = scenario.facts["engine_host_killed"]
    assert "Ray actor died" in facts["lost"]["error"], facts["lost"]
    assert facts["after"] >= facts["before"] + 2  # trainer steps on the one engine left


def test_a_node_that_joins_gets_the_lost_engines_replacement_which_serves_from_the_live_version(scenario):
    scenario.need("engine_host_replaced", "finished")
    hosts, run_dir = scenario.facts["hosts"], scenario.facts["run_dir"]
    facts, lost = scenario.facts["engine_host_replaced"], scenario.facts["engine_host_killed"]["engine"]
    new, version = facts["engine"], facts["joined"]["version"]
    assert new not in scenario.facts["first_steps"]["placed"]  # a new engine, not the lost one back
    assert [e["node_ip"] for e in facts["placed"]] == [hosts[1].address], facts["placed"]  # on the node that joined
    assert [e["engine"] for e in facts["replacing"]] == [lost], facts["replacing"]
    mine = served_from_the_live_version(run_dir, new, facts["joined"])
    history = [json.loads(line) for line in (run_dir / "fleet.jsonl").read_text().splitlines()]
    assert [h["state"] for h in history if h["engine"] == new][:2] == ["joining", "serving"], history
    assert {h["source"] for h in history if h["engine"] == new} == {f"replacement of {lost}"}
    assert "lost" in [h["state"] for h in history if h["engine"] == lost], history
    stats = json.loads(subprocess.run(INFLIGHT + ["stats", str(run_dir), "--json"], capture_output=True, text=True,
                                      timeout=300, check=True).stdout)
    assert stats["engines"][new]["rollouts"] == len(mine) and stats["engines"][new]["first_version"] >= version
    assert new in [h["engine"] for h in stats["fleet"]]


def served_from_the_live_version(run_dir: Path, engine: str, joined: dict) -> list[RolloutRecord]:
    """`engine`'s rollouts (by dispatch time), having checked that the first samples the version live at its
    join (`joined`: its `fleet.joined` event), or one that went live since, and none an older one."""
    version = joined["version"]
    records = list(read_records(run_dir))
    mine = sorted((r for r in records if isinstance(r, RolloutRecord) and r.engine_id == engine),
                  key=lambda r: r.timings.dispatched_at)
    assert mine and version >= 1
    joined_ts = datetime.fromisoformat(joined["timestamp"].replace("Z", "+00:00")).timestamp()

    def went_live(until: float) -> list[int]:  # versions activated after the join, up to `until`
        return [a.version for a in records if isinstance(a, ActivationRecord) and a.outcome == "activated"
                and a.activated_at is not None and joined_ts < a.activated_at <= until]

    # The record's time is the scheduler's decision; its version is the fleet's when the request went
    # to the engine, after the decision (the journal's fsync between) and before its first token: a
    # version that went live in between is the one it sampled (seen: decided at 78, 79 live 3 ms later).
    first = mine[0]
    at_decision = max(went_live(first.timings.dispatched_at), default=version)
    by_first_token = went_live(first.timings.first_token_at or first.timings.finished_at or first.timings.dispatched_at)
    assert at_decision <= first.dispatched_version and first.dispatched_version in [version, *by_first_token], (
        first.dispatched_version, version, at_decision, by_first_token)
    assert all(r.version_span[0] >= version for r in mine if r.num_completion_tokens)
    return mine


def test_a_node_that_joins_with_room_grows_the_fleet_past_its_count_from_the_live_version(scenario):
    """Nothing lost, `count = 2`, `max_count = 3`: host 4's node joins offering the engine resource, and a
    third engine is started there (its own one-bundle placement group) and joins as any joiner."""
    scenario.need("engine_host_replaced")
    hosts, run_dir, facts = scenario.facts["hosts"], scenario.facts["run_dir"], scenario.facts["grown"]
    new = facts["engine"]
    earlier = set(scenario.facts["first_steps"]["placed"]) | {scenario.facts["engine_host_replaced"]["engine"]}
    assert new not in earlier
    assert [e["node_ip"] for e in facts["placed"]] == [hosts[4].address], facts["placed"]
    # One engine serving and the replacement starting: room for one more, and it starts beside the
    # replacement instead of after it (a bundle whose replacement is starting holds its node already).
    assert [(e["engines"], e["max_count"]) for e in facts["growing"]] == [(1, 3)], facts["growing"]
    assert facts["replacing"]["timestamp"] < facts["growing"][0]["timestamp"] < facts["replacement_joined"]["timestamp"]
    served_from_the_live_version(run_dir, new, facts["joined"])
    history = [json.loads(line) for line in (run_dir / "fleet.jsonl").read_text().splitlines()]
    assert [h["state"] for h in history if h["engine"] == new][:2] == ["joining", "serving"], history
    assert {h["source"] for h in history if h["engine"] == new} == {"growth"}


def test_a_trainer_host_killed_stops_the_run_with_one_named_line_and_exit_2(scenario):
    scenario.need("trainer_host_killed")
    facts = scenario.facts["trainer_host_killed"]
    assert facts["code"] == 2, facts["output"][-3000:]
    errors = [line for line in facts["output"].splitlines() if line.startswith("inflight: error:")]
    assert len(errors) == 1 and "trainer" in errors[0], facts["output"][-3000:]
    assert "Traceback" not in facts["output"]
    assert facts["seconds"] < 120  # bounded: Ray's node death, not a collective's timeout


def test_a_sigkilled_orchestrator_leaves_no_process_on_any_host_and_releases_its_placement(scenario):
    scenario.need("orchestrator_killed")
    facts = scenario.facts["orchestrator_killed"]
    assert facts["left"] == {}, facts["left"]
    assert facts["resumed_steps"] >= facts["resumed_from"] + 2
    assert facts["groups"] and all(state == "REMOVED" for state in facts["groups"].values()), facts["groups"]


def test_nothing_of_the_scenario_is_left_on_the_machine(scenario):
    """After the hosts close: no namespace, no process of theirs, no scratch directory."""
    cleanup = scenario.facts["cleanup"]
    assert cleanup == dict(namespaces=[], processes=[], scratch=False), cleanup
