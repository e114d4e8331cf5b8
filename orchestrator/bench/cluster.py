"""`inflight bench cluster --json`: a run over namespace hosts joined by a Ray cluster that the
benchmark starts and stops itself (docs/cluster.md).

Three hosts: host 0 the orchestrator (and the Ray head, and the trainer), hosts 1 and 2 one engine
each. Measured in one run of the command:

- `weights_over_link_ratio`: a version's bytes over the time they take to reach every engine host
  by the run's own path (the run's weight route on uvicorn, `transports.pull.mirror_version` in each
  engine host, concurrently), divided by the same over raw TCP between the same namespaces, same
  bytes, same concurrency; each engine host's link capped (`--cap-mbit`, tbf) so the link is the
  limit. Goal >= 0.8.
- `activation_across_hosts_ms`: the median over the run's activations of the longest pause of an
  engine (the stall an activation adds to generation), from the replay log's activation records.
- `host_loss_to_next_step_s`: host 2's link cut at a step boundary -> the next trainer step.
- `rejoin_s`: the link restored (after the engine was fenced) -> the engine re-synced and serving.
- `leftovers`: namespaces and processes of the benchmark left after it closed its hosts (must be 0).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WEIGHT_TOKEN = "bench-token"
RAW_PORT, PULL_PORT = 47001, 47002


def register(bench_sub) -> None:
    p = bench_sub.add_parser("cluster", help="a run over namespace hosts and a Ray cluster: weights over the "
                                             "link, activation across hosts, host loss and rejoin",
                             description="Needs root (network namespaces). Starts its own hosts and Ray cluster, "
                                         "and removes them.")
    p.add_argument("--steps", type=int, default=40, help="trainer steps of the run (the cut comes at step 5)")
    p.add_argument("--cap-mbit", type=float, default=200.0, help="each engine host's link cap (tbf)")
    p.add_argument("--megabytes", type=int, default=48, help="the version's size for the link measurement")
    p.add_argument("--model", default="models/tiny-rl", help="the run's model (built if missing)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=bench_command)


def bench_command(args) -> int:
    result = run_bench(args.steps, args.cap_mbit, args.megabytes, Path(args.model))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            print(f"{key:28s} {value}")
    return 0


def run_bench(steps: int, cap_mbit: float, megabytes: int, model: Path) -> dict:
    from orchestrator.bench.hosts import Hosts
    from orchestrator.bench.ray_hosts import RayOnHosts
    from orchestrator.model import ensure_model

    model = Path(ensure_model(str(model), preset="tiny-rl")).resolve()
    base = Path(tempfile.mkdtemp(prefix="inflight-bench-cluster-"))
    result: dict = {"hosts": 3, "engine_hosts": 2, "steps": steps, "cap_mbit": cap_mbit}
    hosts = Hosts(3, hide=[str(base)], hide_except=(0,), read_only=[str(model.parent)])
    names, pids = {h.netns for h in hosts} | {hosts.switch}, []
    ray = RayOnHosts(hosts, resources={1: {"engine": 1}, 2: {"engine": 1}})
    try:
        result.update(link_ratio(hosts, base, cap_mbit, megabytes << 20))
        ray.start()
        result.update(run_with_a_cut(hosts, base, model, ray.address, steps))
        pids = [p for h in hosts for p in h.processes()]
    finally:
        hosts.close()
        ray.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    result["leftovers"] = len(names & set(listed)) + sum(1 for p in pids if Path(f"/proc/{p}").exists())
    return result


# -- the link: raw TCP against the run's pull ---------------------------------------------------------

_RAW_SERVER = r"""
import socket, sys, threading
size, clients = int(sys.argv[1]), int(sys.argv[2])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[3], int(sys.argv[4]))); srv.listen(8); print("ready", flush=True)
block = b"\0" * (1 << 20)
def send(conn):
    left = size
    while left:
        n = conn.send(block[:min(left, len(block))]); left -= n
    conn.close()
threads = []
for _ in range(clients):
    conn, _ = srv.accept(); t = threading.Thread(target=send, args=(conn,)); t.start(); threads.append(t)
for t in threads: t.join()
"""

_RAW_CLIENT = r"""
import socket, sys, time
t = time.perf_counter(); s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=300)
got = 0
while chunk := s.recv(1 << 20): got += len(chunk)
print(got, time.perf_counter() - t)
"""

_PULL_SERVER = r"""
import socket, sys, uvicorn
from pathlib import Path
from starlette.applications import Starlette
from orchestrator.cluster.weights import weights_routes
sock = socket.socket(); sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind((sys.argv[2], int(sys.argv[3]))); sock.listen(16)
print("ready", flush=True)
uvicorn.Server(uvicorn.Config(Starlette(routes=weights_routes(Path(sys.argv[1]), sys.argv[4])),
                              log_level="warning", lifespan="off")).run(sockets=[sock])
"""

_PULL_CLIENT = r"""
import sys, time, tempfile
from transports.pull import mirror_version
t = time.perf_counter()
path = mirror_version(sys.argv[1], sys.argv[2], 1, tempfile.mkdtemp(), timeout_s=600)
print(sum(p.stat().st_size for p in path.iterdir()), time.perf_counter() - t)
"""


def publish_version(root: Path, nbytes: int) -> int:
    """Version 1 of `nbytes` of float32 tensors, published by the filesystem transport (the trainer's)."""
    import torch

    from transports.factory import create_weight_synchronizer

    count = 8
    state = {f"layer{i}.weight": torch.randn(nbytes // 4 // count) for i in range(count)}
    sync = create_weight_synchronizer(state_dict=lambda: state, engines=[], colocated=False, transport="filesystem",
                                      filesystem_root=root)
    sync.init_communicator()
    sync.mark_stale()
    sync.sync_weights()
    sync.shutdown()
    return sum(p.stat().st_size for p in (root / "v00000001").iterdir() if p.suffix == ".safetensors")


def _concurrent(hosts, server_argv, client_argv_of, engine_hosts) -> float:
    """Start the server in host 0, the clients in `engine_hosts` at once; the slowest client's seconds."""
    from orchestrator.bench.ray_hosts import host_env

    h0 = hosts[0]
    server = h0.popen(server_argv, env=host_env(h0), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = server.stdout.readline().decode()
        if "ready" not in line:
            raise RuntimeError(f"benchmark server did not start: {server.stderr.read().decode()[-2000:]}")
        time.sleep(0.5)  # uvicorn's accept loop after the bind
        clients = [h.popen(client_argv_of(h), env=host_env(h), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                   for h in engine_hosts]
        seconds = []
        for c in clients:
            out, err = c.communicate(timeout=600)
            if c.returncode:
                raise RuntimeError(f"benchmark client failed: {err.decode()[-2000:]}")
            seconds.append(float(out.split()[-1]))
        return max(seconds)
    finally:
        server.kill()
        server.wait(10)


def link_ratio(hosts, base: Path, cap_mbit: float, nbytes: int) -> dict:
    engine_hosts = [hosts[1], hosts[2]]
    for h in engine_hosts:
        h.cap(cap_mbit)
    try:
        root = base / "weights"
        size = publish_version(root, nbytes)
        h0 = hosts[0]
        raw_s = _concurrent(hosts, [sys.executable, "-c", _RAW_SERVER, str(size), str(len(engine_hosts)), h0.address,
                                    str(RAW_PORT)],
                            lambda h: [sys.executable, "-c", _RAW_CLIENT, h0.address, str(RAW_PORT)], engine_hosts)
        pull_s = _concurrent(hosts, [sys.executable, "-c", _PULL_SERVER, str(root), h0.address, str(PULL_PORT),
                                     WEIGHT_TOKEN],
                             lambda h: [sys.executable, "-c", _PULL_CLIENT, f"http://{h0.address}:{PULL_PORT}",
                                        WEIGHT_TOKEN], engine_hosts)
    finally:
        for h in engine_hosts:
            h.uncap()
    return {"version_bytes": size, "raw_tcp_s": round(raw_s, 3), "pull_s": round(pull_s, 3),
            "raw_tcp_mb_per_s_per_host": round(size / raw_s / 1e6, 2), "pull_mb_per_s_per_host": round(size / pull_s / 1e6, 2),
            "weights_over_link_ratio": round(raw_s / pull_s, 3)}


# -- the run: activation across hosts, a cut link, its rejoin ---------------------------------------------

def run_with_a_cut(hosts, base: Path, model: Path, address: str, steps: int) -> dict:
    from orchestrator.bench.ray_hosts import ClusterRun, write_cluster_config
    from replay.log import read_records
    from replay.records import ActivationRecord

    config = write_cluster_config(base / "config.toml", model, address, engines=2, extra="unreachable_s = 8.0")
    run_dir = base / "run"
    run = ClusterRun(hosts, config, run_dir, steps)
    cut_after = min(5, steps // 4)
    run.wait_for_steps(cut_after, 900, f"step {cut_after}")
    engine = next(e["engine"] for e in run.events("engine.placed") if e["node_ip"] == hosts[2].address)
    hosts[2].cut()
    cut_at = time.time()
    run.wait_for_steps(cut_after + 1, 600, "a step after the cut")
    run.wait_for(lambda: [e for e in run.events("fleet.fenced") if e["engine"] == engine], 300, "the fence")
    hosts[2].restore()
    restored = time.monotonic()
    run.wait_for(lambda: [e for e in run.events("engine.rejoined") if e["engine"] == engine], 300, "the rejoin")
    rejoin_s = time.monotonic() - restored
    code = run.wait(900)
    if code != 0:
        raise RuntimeError(f"the benchmark's run exited {code}:\n{run.output()[-3000:]}")
    records = list(read_records(run_dir))
    after_cut = sorted(t for t in (_unix(e["timestamp"]) for e in run.events("trainer.step_done")) if t > cut_at)
    stalls = [max(e.pause_s for e in a.engines) * 1000 for a in records
              if isinstance(a, ActivationRecord) and a.outcome == "activated" and a.engines]
    return {"activation_across_hosts_ms": round(statistics.median(stalls), 1) if stalls else None,
            "activations": len(stalls),
            "host_loss_to_next_step_s": round(after_cut[0] - cut_at, 2) if after_cut else None,
            "rejoin_s": round(rejoin_s, 2)}


def _unix(timestamp: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
