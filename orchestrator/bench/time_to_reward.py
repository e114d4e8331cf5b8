"""`inflight bench time-to-reward --json`: seconds from a command's start to the first trainer
step whose batch reward reaches the target (0.9), for `inflight run` and for the plain
synchronous loop over transformers `generate()` (`orchestrator.bench.sync_reference`), on the
same model, task and GRPO settings, one after the other.

Workloads (one row each):
* `small`: the `small-rl` preset (69M parameters, init std 0.02), the digits task, 8 prompts x
  4 samples, 64 new tokens, lr 3e-3 (the side-by-side of issue 22);
* `tiny`: the embedded default (`tiny-rl`, digits, 8 x 8, 16 new tokens, lr 3e-3).

Per row: `inflight_s_to_0_9`, `sync_reference_s_to_0_9` (null: not reached within
`--max-steps`), `time_to_reward_ratio` (reference over inflight: > 1 means inflight is
faster; absent unless both reached it), `inflight_steps_to_0_9`, `sync_reference_steps_to_0_9`,
`staleness_mean` (of the samples inflight consumed up to then), `trainer_s_per_step` (median
of the trainer's own step compute), `trainer_checkpoint_s_per_step` and `trainer_journal_s_per_step`
(the mean over every step: with `trainer.checkpoint_every = k` a checkpoint every k-th step, a
journal entry for the others; with background checkpoints, the default, the snapshot the step
waits for), `trainer_checkpoint_write_s_background` (median seconds of a background write, off
the critical path), `trainer_publish_s_per_step`,
`sync_reference_generate_s_per_step`, `sync_reference_train_s_per_step`, `startup_s` (inflight's
command start to its first rollout) and `startup` (its phases, `orchestrator.run.startup`); with
`--after-target N` each inflight run goes on N steps past the one that reached the target, and
`inflight_reward_min_after_target` is the lowest batch reward of those (a collapse after
learning shows there; absent when the run stopped at the target). The
first row's keys are repeated at the top level. Both commands run as child processes: each time
counts its interpreter start and imports. A reached step stops the `inflight run` (SIGINT, its
graceful stop).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import msgspec

from orchestrator.errors import ConfigError, InflightError

MODELS = Path(".inflight") / "bench-models"
WORKLOADS = {
    "small": {"preset": "small-rl", "group_size": 4, "batch_groups": 8, "max_tokens": 64, "lr": 3e-3},
    "tiny": {"preset": "tiny-rl", "group_size": 8, "batch_groups": 8, "max_tokens": 16, "lr": 3e-3},
}
POLL_S = 0.5
STOP_GRACE_S = 120.0


def register(bench_sub) -> None:
    p = bench_sub.add_parser("time-to-reward",
                             help="seconds to a batch reward of 0.9: inflight run against a plain synchronous loop")
    p.add_argument("--workloads", nargs="+", default=["small", "tiny"], choices=sorted(WORKLOADS))
    p.add_argument("--target", type=float, default=0.9)
    p.add_argument("--max-steps", type=int, default=60, help="give up (null) after this many steps")
    p.add_argument("--admission", nargs="+", choices=["eager", "just_in_time"], default=None,
                   help="inflight's scheduler.admission, a row each against one reference run "
                        "(unset: one row of the configured default, unless --variant gives the rows)")
    p.add_argument("--set", action="append", default=[], metavar="TOML",
                   help='extra TOML for the inflight run, e.g. --set "[trainer]\\nthreads = 2"')
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=TOML",
                   help='one more inflight row against the same reference, e.g. '
                        '--variant "sync=[scheduler]\\nmode = \\"sync\\""')
    p.add_argument("--after-target", type=int, default=0, metavar="STEPS",
                   help="keep each inflight run going this many steps past the target (a collapse after it "
                        "shows in inflight_reward_min_after_target); 0: stop at the target")
    p.add_argument("--keep", metavar="DIR", help="keep the run directories under DIR")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=bench_command)


def config_toml(model_dir: Path, workload: dict, admission: str | None) -> str:
    scheduler = f'admission = "{admission}"\n' if admission else ""
    return (f'[engine]\nmodel = "{model_dir}"\n'
            f'[sampling]\nmax_tokens = {workload["max_tokens"]}\n'
            f'[scheduler]\ngroup_size = {workload["group_size"]}\nbatch_groups = {workload["batch_groups"]}\n{scheduler}'
            f'[trainer]\nlr = {workload["lr"]}\n'
            f'[eval]\nat_start = false\n'
            f'[http]\nenabled = false\n'
            f'[run]\nmodel_preset = "{workload["preset"]}"\nprogress = "none"\ntensorboard = false\n')


def _merge_toml(base: str, extra: list[str]) -> str:
    """Later tables override earlier keys: parse both and merge, table by table."""
    import tomllib

    merged = tomllib.loads(base)
    for text in extra:
        try:
            parsed = tomllib.loads(text.replace("\\n", "\n"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError("--set/--variant", f"{text!r} is not TOML: {exc}") from None
        for table, values in parsed.items():
            if isinstance(values, dict):
                merged.setdefault(table, {}).update(values)
            else:
                merged[table] = values
    top = [f"{k} = {json.dumps(v)}" for k, v in merged.items() if not isinstance(v, dict)]
    tables = [f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items())
              for name, values in merged.items() if isinstance(values, dict)]
    # JSON scalars and flat lists are TOML too (strings, numbers, true/false, [..]).
    return "\n".join(top) + ("\n" if top else "") + "".join(tables)


def _seed(extra: list[str]) -> int:
    """The run's seed that `--set` gives (run.seed; 0 when none does): it seeds the model's build too."""
    import tomllib

    seed = tomllib.loads(_merge_toml("", extra)).get("run", {}).get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError("--set", f"run.seed must be an integer, got {seed!r}")
    return seed


def _model_for(preset: str, seed: int) -> tuple[Path, str, int]:
    """(directory, preset, seed) of the workload's model: one directory per seed, since a model
    built with another seed is refused by the run (it asked for this one)."""
    return MODELS / (preset if seed == 0 else f"{preset}-seed{seed}"), preset, seed


def run_reference(model_dir: Path, config_json: str, target: float, max_steps: int) -> dict:
    proc = subprocess.run([sys.executable, "-m", "orchestrator.bench.sync_reference", "--model", str(model_dir),
                           "--config-json", config_json, "--target", str(target), "--max-steps", str(max_steps)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise InflightError(f"the synchronous reference failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    steps = [x for x in lines if "step" in x]
    summary = next(x for x in lines if x.get("summary"))
    return {"s_to_target": summary["s_to_target"], "steps_to_target": summary["steps_to_target"],
            "generate_s_per_step": statistics.median(x["generate_s"] for x in steps),
            "train_s_per_step": statistics.median(x["train_s"] for x in steps),
            "rewards": [round(x["reward"], 4) for x in steps]}


def _events(run_dir: Path) -> list[dict]:
    path = run_dir / "orchestrator.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue  # a line being written
    return out


def _unix(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def run_inflight(config_path: Path, run_dir: Path, target: float, max_steps: int, after_target: int = 0) -> dict:
    """`after_target`: steps the run goes on past the one that reached the target (then stopped)."""
    started = time.time()
    log = (run_dir.parent / f"{run_dir.name}.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.commands.cli", "run", str(config_path), "--run-dir",
                             str(run_dir), "--max-steps", str(max_steps)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    reached = None
    try:
        while proc.poll() is None:
            time.sleep(POLL_S)
            done = [e for e in _events(run_dir) if e.get("event") == "trainer.step_done" and e.get("reward") is not None]
            reached = reached or next((e for e in done if e["reward"] >= target), None)
            if reached is not None and max((e["step"] for e in done), default=0) >= reached["step"] + after_target:
                break
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # the graceful stop: every rollout gets its record
        code = proc.wait(STOP_GRACE_S)
    except BaseException:
        _kill(proc)
        raise
    finally:
        log.close()
    if code not in (0, 130) and reached is None:
        raise InflightError(f"inflight run exited {code}: see {run_dir.parent / (run_dir.name + '.log')}")
    return _inflight_figures(run_dir, started, reached)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _inflight_figures(run_dir: Path, started: float, reached: dict | None) -> dict:
    from replay.log import read_records
    from replay.records import ConsumptionRecord, RolloutRecord

    events = _events(run_dir)
    last_step = reached["step"] if reached else None
    versions: dict[int, int] = {}
    staleness: list[int] = []
    # checkpoint_write_s: a background checkpoint's write, off the step's critical path.
    metrics: dict[str, list[float]] = {"train_s": [], "publish_s": [], "checkpoint_write_s": []}
    # Making steps durable: a checkpoint every trainer.checkpoint_every steps, a journal entry
    # for the others, so the mean over every step (0 where a step wrote none) is what it costs.
    durable: dict[str, list[float]] = {"checkpoint_s": [], "journal_s": []}
    for record in read_records(run_dir):
        if isinstance(record, RolloutRecord):
            versions[record.rollout_id] = record.dispatched_version
        elif isinstance(record, ConsumptionRecord) and (last_step is None or record.step <= last_step):
            staleness += [(record.step - 1) - versions[r] for r in record.rollout_ids if r in versions]
            for key, values in metrics.items():
                if key in record.metrics:
                    values.append(record.metrics[key])
            for key, values in durable.items():
                values.append(record.metrics.get(key, 0.0))
    startup = next((e for e in events if e.get("event") == "run.startup"), None)
    out = {"s_to_target": _unix(reached) - started if reached else None,
           "steps_to_target": last_step,
           "staleness_mean": statistics.mean(staleness) if staleness else None,
           "rewards": [round(e["reward"], 4) for e in events if e.get("event") == "trainer.step_done"]}
    if reached is not None:
        after = [e["reward"] for e in events if e.get("event") == "trainer.step_done" and e.get("reward") is not None
                 and e["step"] > reached["step"]]
        if after:  # observed only: absent when the run stopped at the target
            out["reward_min_after_target"] = min(after)
            out["steps_after_target"] = len(after)
    for key, values in metrics.items():
        if values:
            out[f"{key}_per_step"] = statistics.median(values)
    for key, values in durable.items():
        if any(values):
            out[f"{key}_per_step"] = statistics.mean(values)
    if startup is not None:
        out["startup"] = {k: v for k, v in startup.items() if k.endswith("_s")}
    return out


def measure(name: str, args: argparse.Namespace, work: Path) -> list[dict]:
    """The workload's rows: one reference run, then one inflight run per admission."""
    from orchestrator.config.run import load_config
    from orchestrator.model import ensure_model

    workload = WORKLOADS[name]
    seed = _seed(args.set)
    model_dir = ensure_model(*_model_for(workload["preset"], seed)).resolve()
    reference = None
    rows = []
    admissions = args.admission if args.admission is not None else ([] if args.variant else [None])
    runs = [(admission or "default", admission, args.set) for admission in admissions]
    for variant in args.variant:
        label, sep, text = variant.partition("=")
        if not sep or not label:
            raise ConfigError("--variant", f"expected LABEL=TOML, got {variant!r}")
        runs.append((label, None, [*args.set, text]))
    # Every run's config is written and checked before the first run starts: a bad variant is
    # refused at once, not after the runs before it.
    planned = []
    for suffix, admission, extra in runs:
        label = f"{name}-{suffix}"
        config_path = work / f"{label}.toml"
        config_path.write_text(_merge_toml(config_toml(model_dir, workload, admission), extra))
        config = load_config(config_path)
        if config.run.seed != seed:  # the model and the reference are built once, for --set's seed
            raise ConfigError(f"--variant {suffix}", f"run.seed {config.run.seed} differs from --set's {seed}: "
                                                     "give the seed with --set (one invocation per seed)")
        planned.append((suffix, label, config_path, config))
    for suffix, label, config_path, config in planned:
        if reference is None:  # the same for every admission: the loop has no scheduler
            print(f"time-to-reward: {name}: the synchronous reference ...", file=sys.stderr, flush=True)
            reference = run_reference(model_dir, msgspec.json.encode(config).decode(), args.target, args.max_steps)
        print(f"time-to-reward: {name}: inflight run ({config.scheduler.admission}) ...", file=sys.stderr, flush=True)
        inflight = run_inflight(config_path, work / f"{label}-run", args.target, args.max_steps, args.after_target)
        rows.append({"variant": suffix, **_row(name, workload, config, args, inflight, reference)})
    return rows


def _row(name: str, workload: dict, config, args: argparse.Namespace, inflight: dict, reference: dict) -> dict:
    row: dict = {"workload": f"{name}: {workload['preset']}, digits, {workload['batch_groups']} prompts x "
                             f"{workload['group_size']}, {workload['max_tokens']} tokens, lr {workload['lr']}",
                 "admission": config.scheduler.admission, "mode": config.scheduler.mode,
                 "trainer_threads": config.trainer.threads,
                 "inflight_s_to_0_9": inflight["s_to_target"],
                 "sync_reference_s_to_0_9": reference["s_to_target"],
                 "inflight_steps_to_0_9": inflight["steps_to_target"],
                 "sync_reference_steps_to_0_9": reference["steps_to_target"]}
    if inflight["s_to_target"] and reference["s_to_target"]:
        row["time_to_reward_ratio"] = reference["s_to_target"] / inflight["s_to_target"]
    for key, source in (("staleness_mean", "staleness_mean"), ("trainer_s_per_step", "train_s_per_step"),
                        ("trainer_checkpoint_s_per_step", "checkpoint_s_per_step"),
                        ("trainer_journal_s_per_step", "journal_s_per_step"),
                        ("trainer_publish_s_per_step", "publish_s_per_step"),
                        ("trainer_checkpoint_write_s_background", "checkpoint_write_s_per_step"),
                        ("inflight_reward_min_after_target", "reward_min_after_target"),
                        ("inflight_steps_after_target", "steps_after_target")):
        if inflight.get(source) is not None:
            row[key] = inflight[source]
    row["sync_reference_generate_s_per_step"] = reference["generate_s_per_step"]
    row["sync_reference_train_s_per_step"] = reference["train_s_per_step"]
    if "startup" in inflight:
        row["startup_s"] = inflight["startup"].get("to_first_rollout_s")
        row["startup"] = inflight["startup"]
    row["inflight_rewards"] = inflight["rewards"]
    row["sync_reference_rewards"] = reference["rewards"]
    if args.target != 0.9:
        row["target"] = args.target
    return row


def bench_command(args: argparse.Namespace) -> int:
    if args.after_target < 0:
        raise ConfigError("--after-target", f"must be >= 0 (steps past the target), got {args.after_target}")
    keep = Path(args.keep) if args.keep else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="inflight-ttr-") as tmp:
        work = keep or Path(tmp)
        rows = []
        for name in args.workloads:
            rows += measure(name, args, work)
    result = {**{k: v for k, v in rows[0].items() if k not in ("workload",)}, "rows": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for row in rows:
            print(row["workload"])
            for key, value in row.items():
                if key not in ("workload", "startup", "inflight_rewards", "sync_reference_rewards"):
                    print(f"  {key:38s} {value}")
    return 0
