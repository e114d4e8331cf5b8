"""A Ray cluster on namespace hosts (`orchestrator.bench.hosts`), started as users start one: `ray start
--head` on one host, `ray start --address=...` on the others, each with its own address, its own
temporary directory (its scratch) and the custom resources that pin roles to it. For the cluster
tests and `inflight bench cluster`; `[cluster]` runs never start a cluster themselves.

Every Ray process of a host lives in that host's PID namespace: killing a host (`Host.kill`) is a
node's death for Ray, and the hosts' clean-up stops the whole cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from orchestrator.bench.hosts import Host, Hosts

ROOT = Path(__file__).resolve().parents[2]
RAY_PORT = 6379
# Ray declares a node dead after this many failed health checks, one every second, each waiting up
# to 10 s: a killed host (connections refused) is dead for Ray in ~10 s (it was ~30 s at Ray's 3 s
# period: 20 s of every test run's host loss), a cut one (no answer) after ~2 min, which leaves a cut
# link that comes back within a minute to the run's own fencing and rejoin.
HEAD_SYSTEM_CONFIG = {"health_check_failure_threshold": 10, "health_check_period_ms": 1000,
                      "health_check_timeout_ms": 10000}
BIN = Path(sys.executable).parent


def host_env(host: Host) -> dict[str, str]:
    """The environment of every process started in `host`: this venv's tools first, the host's
    scratch as its temporary directory (engine logs, pulled versions), no usage reporting."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["TMPDIR"] = str(host.scratch)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env.pop("RAY_ADDRESS", None)
    # Each host's engine binds its own core, as a real host's engine has its host's cores: vLLM's
    # `auto` binding puts every engine of every namespace host on core 0, where two engines (or an
    # engine starting beside one serving) take turns on one core while the other idles.
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[host.index % len(cores)])
    return env


class RayOnHosts:
    def __init__(self, hosts: Hosts, *, head: int = 0, resources: dict[int, dict[str, float]] | None = None,
                 cpus: int = 1) -> None:
        self.hosts, self.head, self.cpus = hosts, head, cpus
        self.resources = resources or {}
        self._links: set[Path] = set()

    def _temp_dir(self, host: Host) -> Path:
        """The host's Ray directory, in its scratch, named by a short link: Ray's socket paths under it
        must stay within AF_UNIX's 107 bytes."""
        target = host.scratch / "ray"
        target.mkdir(parents=True, exist_ok=True)
        link = Path(tempfile.gettempdir()) / f"{self.hosts.tag}-r{host.index}"
        if not link.is_symlink():
            link.symlink_to(target)
        self._links.add(link)
        return link

    def close(self) -> None:
        """Remove the links (the cluster itself ends with the hosts)."""
        for link in self._links:
            link.unlink(missing_ok=True)
        self._links.clear()

    @property
    def address(self) -> str:
        return f"{self.hosts[self.head].address}:{RAY_PORT}"

    def start(self, later: tuple[int, ...] = ()) -> RayOnHosts:
        """The head, then every other host but those `later` names (they `join` when the caller says)."""
        self.join(self.head)
        for host in self.hosts:
            if host.index != self.head and host.index not in later:
                self.join(host.index)
        return self

    def join(self, index: int) -> None:
        """`ray start` on host `index` (the head, or a node joining the head): also after `restart()`."""
        host = self.hosts[index]
        argv = [str(BIN / "ray"), "start", f"--node-ip-address={host.address}", f"--num-cpus={self.cpus}",
                f"--temp-dir={self._temp_dir(host)}", "--disable-usage-stats"]
        if index == self.head:
            argv += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false",
                     f"--system-config={json.dumps(HEAD_SYSTEM_CONFIG)}"]
        else:
            argv += [f"--address={self.address}"]
        if self.resources.get(index):
            argv.append(f"--resources={json.dumps(self.resources[index])}")
        out = host.run(argv, env=host_env(host), capture_output=True, timeout=180)
        if out.returncode:
            raise RuntimeError(f"ray start on {host.name} ({host.address}) exited {out.returncode}:\n"
                               f"{out.stdout.decode()[-2000:]}\n{out.stderr.decode()[-2000:]}")


def write_cluster_config(path: Path, model: Path, address: str, *, engines: int = 2, trainer_nodes: int = 1,
                 extra: str = "", max_engines: int | None = None) -> Path:
    most = f", max_count = {max_engines}" if max_engines is not None else ""
    trainer = '\ntrainer = { nodes = %d, node_resource = "trainer" }' % trainer_nodes if trainer_nodes > 1 else ""
    path.write_text(f"""
[engine]
model = "{model}"
max_model_len = 256
max_num_seqs = 64
chunk_timeout_s = 60.0
[run]
progress = "plain"
tensorboard = false
[transport]
keep_last = 64
[cluster]
backend = "ray"
address = "{address}"
engines = {{ count = {engines}{most}, node_resource = "engine" }}{trainer}
{extra}
""")
    return path


class ClusterRun:
    """`inflight run` in host 0; its output in `log`."""

    def __init__(self, hosts: Hosts, config: Path, run_dir: Path, steps: int, *extra: str) -> None:
        self.hosts, self.run_dir, self.log = hosts, run_dir, run_dir.parent / f"{run_dir.name}.out"
        h0 = hosts[0]
        argv = [str(BIN / "inflight"), "run", str(config), "--run-dir", str(run_dir), "--max-steps", str(steps),
                *extra]
        self.proc = h0.popen(argv, env=host_env(h0), cwd=str(ROOT), stdout=self.log.open("w"),
                             stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def wait(self, timeout: float = 900) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"inflight run did not end within {timeout}s\n{self.output()[-4000:]}") from None

    def events(self, name: str) -> list[dict]:
        path = self.run_dir / "orchestrator.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            if f'"{name}"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
        return [e for e in out if e.get("event") == name]

    def steps_done(self) -> int:
        return consumed_steps(self.run_dir)

    def steps_logged(self) -> int:
        """The newest step the orchestrator's log says was done: a cheap stand-in for `steps_done`
        while waiting (a few hundred lines, where the replay log is thousands of records)."""
        return max((e.get("step", 0) for e in self.events("trainer.step_done")), default=0)

    def wait_for_steps(self, steps: int, timeout: float, what: str) -> int:
        """Until the replay log records the consumption of step `steps`: polled on the orchestrator's
        log, then confirmed on the replay log (whose consumption record may follow its line)."""
        deadline = time.monotonic() + timeout
        self.wait_for(lambda: self.steps_logged() >= steps, timeout, what)
        return self.wait_for(lambda: (done := consumed_steps(self.run_dir)) >= steps and done,
                             max(1.0, deadline - time.monotonic()), what)

    def wait_for(self, predicate, timeout: float, what: str):
        """Polls `predicate` until it holds; between polls at least three times what one poll took, so
        that a poll that reads a growing log takes at most a quarter of a core from the run."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            began = time.monotonic()
            value = predicate()
            if value:
                return value
            if self.proc.poll() is not None:
                raise AssertionError(f"{what}: inflight run exited {self.proc.returncode}\n{self.output()[-4000:]}")
            time.sleep(max(0.5, 3 * (time.monotonic() - began)))
        raise AssertionError(f"{what}: not within {timeout}s\n{self.output()[-4000:]}")


def consumed_steps(run_dir: Path) -> int:
    from replay.log import read_records
    from replay.records import ConsumptionRecord

    try:
        return sum(1 for r in read_records(run_dir) if isinstance(r, ConsumptionRecord))
    except Exception:  # noqa: BLE001 - the log is being written
        return 0


def run_leftovers(hosts: Hosts) -> dict[int, list[str]]:
    """The processes of the run left in each host (Ray's own daemons excluded): vLLM, torchrun,
    the trainer, the orchestrator, Ray workers that ran our actors."""
    out = {}
    for host in hosts:
        if not host.alive:
            continue
        names = []
        for pid in host.processes():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if any(k in cmd for k in ("vllm", "orchestrator.", "torch.distributed.run", "ray::EngineHost",
                                       "ray::TrainerNode", "inflight run", "VLLM")):
                names.append(cmd[:120])
        if names:
            out[host.index] = names
    return out
