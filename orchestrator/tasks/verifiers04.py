"""A verifiers 0.4 environment as an agent task (issue #33, docs/agents.md):

    [task]
    entrypoint = "orchestrator.tasks.verifiers04:make"
    args = {env = "my_env", harness = "null", runtime = "subprocess", taskset = {num_tasks = 64}}

verifiers 0.4 lives in a venv of its own (`make verifiers-venv`: `.venv-verifiers`; it pins
`mcp==2.0.0` and `openai<3`, which the run's venv cannot hold), so its environment runs in a
driver process started from that venv's python (`verifiers04_driver.py`, reached through
`verifiers04_link.py`): one process for the whole run, serving every episode. `make` starts it
at start, before any engine: it loads the environment (`verifiers.v1.load_environment`, the
taskset named by `env`), prepares its harness in the runtime (a local runtime fetches the
harness program's `uv` dependencies then, once), and hands back the taskset's tasks, which are
the task's rows. Each episode is one rollout of that environment in the driver, its model client
verifiers' own `TrainClient` pointed at the episode's URL (`{run}/e/{episode}/v1`), so every
generate call its harness makes lands in the episode (the token route, `token_route.py`); the
episode's reward is the trace's reward (the sum of its weighted rewards).

Arguments (`task.args`):
- `env`: the taskset id (an installed package, or a module on the run's search path: the working
  directory, the config's directory), as `vf-eval` takes it.
- `harness`: a harness id (`null`, `bash`, ...) or its config table; absent: the taskset's own.
- `runtime`: `subprocess` (local: the harness program runs as a process on this machine) or
  `docker` (where a `docker` command is present), or a table (`{type = "docker", image = ...}`).
  Prime sandboxes, Modal and E2B are remote and refused by name; so are podman and apptainer,
  never run here.
- `taskset`: the taskset's config fields.
- `renderer`: the `renderers` config verifiers' TrainClient renders with (a table, e.g.
  `{name = "custom", import_path = "path/to/file.py:Class"}`); absent: resolved from the model.
- `venv`: the verifiers 0.4 venv (default: the project's `.venv-verifiers`; a relative path is
  read from the working directory).
- `timeout_s`: an episode's bound (default 600); `start_timeout_s`: the driver's start (default
  600: the first start fetches the harness program's dependencies).
- `trace_dir`: where the driver appends each episode's verifiers episode (its traces) as JSON
  lines (absent: not kept).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path

from orchestrator.errors import ConfigError
from orchestrator.tasks.agent_endpoint import MODEL_NAME
from orchestrator.tasks.verifiers04_link import TOKEN_VAR, DriverLink

FIELD = "task.args"
PROJECT_VENV = Path(__file__).resolve().parents[2] / ".venv-verifiers"
LOCAL = ("subprocess", "docker")
REMOTE = {"prime": "Prime sandboxes", "modal": "Modal", "e2b": "E2B"}
NOT_RUN_HERE = ("podman", "apptainer")


def make(env: str, harness: str | dict | None = None, runtime: str | dict = "subprocess", taskset: dict | None = None,
         renderer: dict | None = None, venv: str | None = None, timeout_s: float = 600.0,
         start_timeout_s: float = 600.0, trace_dir: str | None = None, model_dir: str | None = None,
         search_path: Sequence[str] | None = None) -> Verifiers04Task:
    """The task of verifiers 0.4 environment `env` (docs/agents.md); `model_dir` and `search_path`
    are the run's (offered by `make_task`)."""
    if not isinstance(env, str) or not env:
        raise ConfigError(f"{FIELD}.env", f"name a verifiers 0.4 environment (its taskset id), got {env!r}")
    runtime_config = check_runtime(runtime)
    for name, value in (("taskset", taskset), ("renderer", renderer)):
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"{FIELD}.{name}", f"must be a table, got {value!r}")
    if harness is not None and not isinstance(harness, (str, dict)):
        raise ConfigError(f"{FIELD}.harness", f"must be a harness id or its table, got {harness!r}")
    for name, value in (("timeout_s", timeout_s), ("start_timeout_s", start_timeout_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ConfigError(f"{FIELD}.{name}", f"must be a number of seconds > 0, got {value!r}")
    if model_dir is None:
        raise ConfigError(f"{FIELD}.env", "a verifiers 0.4 environment needs the run's model (its renderer's "
                                          "tokenizer): build it through the run's [task] entrypoint")
    python = venv_python(venv)
    config = {"env": env, "harness": harness, "runtime": runtime_config, "taskset": dict(taskset or {}),
              "renderer": renderer, "model_dir": str(Path(model_dir).resolve()), "model": MODEL_NAME,
              "api_key_var": TOKEN_VAR, "trace_dir": str(Path(trace_dir).resolve()) if trace_dir else None,
              "search_path": [str(Path(p).resolve()) for p in (search_path or [])] + [str(Path.cwd())]}
    link = DriverLink(python, config, start_timeout_s=float(start_timeout_s), timeout_s=float(timeout_s))
    ready = link.start()
    link.rows = ready["rows"]
    return Verifiers04Task(link, ready["env_id"])


def check_runtime(runtime) -> dict:
    """The runtime's config table: a local one, or a ConfigError naming `task.args.runtime`."""
    if isinstance(runtime, str):
        runtime = {"type": runtime}
    if not isinstance(runtime, dict) or not isinstance(runtime.get("type"), str):
        raise ConfigError(f"{FIELD}.runtime", f"must be a runtime's name or a table with its type, got {runtime!r}")
    kind = runtime["type"]
    if kind in REMOTE:
        raise ConfigError(f"{FIELD}.runtime", f"{kind!r} ({REMOTE[kind]}) is a remote runtime: refused. The run "
                                              "serves its episodes on its own host; use \"subprocess\" or \"docker\"")
    if kind in NOT_RUN_HERE:
        raise ConfigError(f"{FIELD}.runtime", f"{kind!r} is not a runtime this task has run: use \"subprocess\" or "
                                              "\"docker\"")
    if kind not in LOCAL:
        raise ConfigError(f"{FIELD}.runtime", f"unknown runtime {kind!r}: use \"subprocess\" or \"docker\"")
    if kind == "docker" and shutil.which("docker") is None:
        raise ConfigError(f"{FIELD}.runtime", "\"docker\" needs a docker command on this machine, and there is "
                                              "none on PATH: use \"subprocess\"")
    return dict(runtime)


def venv_python(venv: str | None) -> Path:
    """The verifiers 0.4 venv's python (ConfigError naming `task.args.venv` when missing)."""
    path = PROJECT_VENV if venv is None else Path(venv).expanduser()
    if not path.is_absolute():
        path = Path.cwd() / path
    python = path / "bin" / "python"
    if not python.exists():
        raise ConfigError(f"{FIELD}.venv", f"no verifiers 0.4 venv at {path} (no {python}): run `make "
                                           "verifiers-venv` in the project (it builds .venv-verifiers), or name "
                                           "yours in task.args.venv")
    return python


class Verifiers04Task:
    """Rows: the taskset's tasks. `run(client, row)`: one rollout in the driver, its reward."""

    def __init__(self, link: DriverLink, env_id: str) -> None:
        self.link = link
        self.name = env_id

    def __len__(self) -> int:
        return len(self.link.rows)

    def row(self, index: int) -> dict:
        if not 0 <= index < len(self.link.rows):
            raise IndexError(f"row {index} of {len(self.link.rows)}")
        return dict(self.link.rows[index])

    def run(self, client, row: dict) -> float:
        """In the episode's worker thread: the episode's URL read off its client (the run's
        base URL names the episode), one rollout there, the trace's reward."""
        url = str(client.base_url).rstrip("/")  # the episode's: {run}/e/{episode}/v1
        answer = self.link.episode(row["idx"], url, client.api_key)
        return float(answer["reward"])

    def close(self) -> None:
        self.link.close()
