"""The verifiers 0.4 driver (docs/agents.md): run by the verifiers 0.4 venv's python, never imported
by the run (its venv has no verifiers 0.4). `orchestrator/tasks/verifiers04.py` starts it:

    .venv-verifiers/bin/python -I verifiers04_driver.py CONFIG_JSON
    .venv-verifiers/bin/python -I verifiers04_driver.py --prepare     (make verifiers-venv: see below)

CONFIG_JSON: {"env": taskset id, "taskset": {its config fields}, "harness": id or {config} or null,
"runtime": {runtime config}, "renderer": {renderers config} or null, "model_dir": the run's model,
"model": the model name sent, "api_key_var": the environment variable the token is put in,
"trace_dir": where to append each episode's trace as JSON (or null)}.

It loads the environment once (`verifiers.v1.load_environment`, every agent's runtime set to
the configured one, one interception server), prepares every agent's harness once (a local
runtime fetches the harness program's `uv` dependencies here, at start, not inside an episode),
and answers on stdout, one JSON line each:

    {"ready": {"rows": [task data, ...], "env_id": ...}}      or   {"fatal": {"field", "reason"}}

then serves episodes from stdin, any number at once, one JSON line each:

    in:  {"id": N, "idx": task index, "url": the episode's base URL, "token": the run's}   (or {"cancel": N})
    out: {"id": N, "reward": the trace's reward, "rewards": {...}}       or   {"id": N, "error": "..."}

Each episode is one rollout of `env.run_episode` whose model client is verifiers' own
`TrainClient` pointed at the episode's URL: every generate call of the harness lands in that
episode. stdout carries only these lines: anything else that writes to it (verifiers, a harness)
goes to stderr. The driver ends when stdin closes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from pathlib import Path

LOCAL_RUNTIMES = ("subprocess", "docker")


def main() -> None:
    # Run as a script, its own directory (orchestrator/tasks, which holds the 0.1 adapter
    # `verifiers.py`) would shadow the verifiers package: it is not on the path.
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if str(Path(p or ".").resolve()) != here]
    out = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own stdout
    os.dup2(2, 1)  # everything else that prints goes to stderr
    sys.stdout = sys.stderr
    if sys.argv[1] == "--prepare":
        asyncio.run(prepare_chat_program())
        return
    config = json.loads(sys.argv[1])
    for entry in reversed(config.get("search_path") or []):
        sys.path.insert(0, entry)
    asyncio.run(Driver(config, out).serve())


async def prepare_chat_program() -> None:
    """`make verifiers-venv`: verifiers' own chat program (the `null` and `bash` harnesses') made
    ready in the local runtime, its `uv` dependencies fetched now rather than at a run's start."""
    from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE
    from verifiers.v1.runtimes import SubprocessConfig, provision_runtime

    async with provision_runtime(SubprocessConfig(), name=f"inflight-prepare-{os.getpid()}") as runtime:
        program = await runtime.prepare_uv_script(CHAT_PROGRAM_SOURCE)
        print(f"verifiers' chat program is ready: {program[-1]}", file=sys.stderr)


class Fatal(Exception):
    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


class Driver:
    def __init__(self, config: dict, out) -> None:
        self.config = config
        self.out = out
        self.tasks: dict[int, object] = {}
        self.running: dict[int, asyncio.Task] = {}

    def send(self, message: dict) -> None:
        self.out.write(json.dumps(message) + "\n")
        self.out.flush()

    async def serve(self) -> None:
        try:
            env = self.load()
        except Fatal as exc:
            self.send({"fatal": {"field": exc.field, "reason": exc.reason}})
            return
        async with env.serving():
            try:
                await self.prepare(env)
            except Exception as exc:  # noqa: BLE001 - reported to the run, named
                self.send({"fatal": {"field": "task.args.harness", "reason": f"preparing the harness failed: "
                                                                           f"{type(exc).__name__}: {exc}"}})
                return
            self.env = env
            self.send({"ready": {"env_id": env.config.env_id,
                                 "rows": [t.data.model_dump(mode="json", exclude_none=True)
                                          for t in self.tasks.values()]}})
            await self.read_requests()

    # -- start -------------------------------------------------------------------------------------
    def load(self):
        import verifiers.v1 as vf
        from pydantic import ValidationError

        raw = {"taskset": {"id": self.config["env"], **(self.config.get("taskset") or {})},
               "interception": {"type": "server"}}
        try:
            vf.import_taskset(self.config["env"])
            cls = vf.env_config_type(self.config["env"])
        except (ModuleNotFoundError, ImportError, TypeError, ValueError, AttributeError) as exc:
            raise Fatal("task.args.env", f"no verifiers 0.4 environment {self.config['env']!r}: {exc}") from None
        roles = [name for name, f in cls.model_fields.items() if isinstance(f.default, vf.AgentConfig)]
        for role in roles:
            agent: dict = {"runtime": self.config["runtime"]}
            harness = self.config.get("harness")
            if harness is not None:
                agent["harness"] = {"id": harness} if isinstance(harness, str) else harness
            raw[role] = agent
        try:
            env_config = vf.resolve_env_config(raw)
        except (ValidationError, ModuleNotFoundError, TypeError, ValueError) as exc:
            raise Fatal("task.args", f"the environment's config is refused: {exc}") from None
        try:
            env = vf.load_environment(env_config)
        except Exception as exc:  # noqa: BLE001 - the environment's own failure, named
            raise Fatal("task.args.env", f"loading {self.config['env']!r} failed: {type(exc).__name__}: {exc}") \
                from None
        for name, spec in env._agent_specs.items():  # an environment may pin its own roles' runtimes
            if spec.runtime.type not in LOCAL_RUNTIMES:
                raise Fatal("task.args.runtime", f"the environment's agent {name!r} runs in the "
                                                 f"{spec.runtime.type!r} runtime: only local runtimes "
                                                 f"({', '.join(LOCAL_RUNTIMES)}) are served")
        if not env.taskset.bounded:
            raise Fatal("task.args.env", f"{self.config['env']!r} is an infinite taskset: the run draws rows by "
                                         "index from a finite one")
        self.tasks = {task.data.idx: task for task in env.taskset}
        if not self.tasks:
            raise Fatal("task.args.env", f"{self.config['env']!r} has no tasks")
        return env

    async def prepare(self, env) -> None:
        """Each distinct harness prepared once in a runtime of the configured kind: a local
        runtime keeps the prepared program (its `uv` environment) for every later rollout."""
        from verifiers.v1.runtimes import provision_runtime

        seen = set()
        for name, harness in env._harnesses.items():
            runtime_config = env._agent_specs[name].runtime
            key = (harness.config.model_dump_json(), runtime_config.model_dump_json())
            if key in seen or runtime_config.type != "subprocess":
                continue
            seen.add(key)
            async with provision_runtime(runtime_config, name=f"inflight-prepare-{os.getpid()}") as runtime:
                await harness.setup(runtime)

    # -- episodes ----------------------------------------------------------------------------------
    async def read_requests(self) -> None:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 24)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        try:
            while line := await reader.readline():
                request = json.loads(line)
                if "cancel" in request:
                    task = self.running.get(request["cancel"])
                    if task is not None:
                        task.cancel()
                    continue
                self.running[request["id"]] = asyncio.ensure_future(self.episode(request))
        finally:
            for task in list(self.running.values()):
                task.cancel()
            await asyncio.gather(*self.running.values(), return_exceptions=True)

    async def episode(self, request: dict) -> None:
        number = request["id"]
        try:
            reply = await self.rollout(request)
        except asyncio.CancelledError:
            reply = {"error": "cancelled"}
        except Exception as exc:  # noqa: BLE001 - the episode's failure, reported named
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            self.running.pop(number, None)
        self.send({"id": number, **reply})

    async def rollout(self, request: dict) -> dict:
        import verifiers.v1 as vf

        os.environ[self.config["api_key_var"]] = request["token"]  # the run's, one for all its episodes
        task = self.tasks.get(request["idx"])
        if task is None:
            return {"error": f"no task idx {request['idx']!r} in {self.config['env']!r}"}
        client = vf.TrainClientConfig(base_url=request["url"], api_key_var=self.config["api_key_var"],
                                      renderer=self.config.get("renderer"),
                                      renderer_model_name=self.config["model_dir"])
        ctx = vf.ModelContext(model=self.config["model"], client=client, sampling=vf.SamplingConfig())
        try:
            episode = await self.env.run_episode(task, ctx)
        finally:
            await self.release(client)
        self.keep(request, episode)
        if episode.errors:
            error = episode.errors[-1]
            return {"error": f"the episode failed: {error.type}: {error.message}"[:2000]}
        if len(episode.traces) != 1:
            return {"error": f"the episode has {len(episode.traces)} traces: one trace per episode is served "
                             "(a single-agent environment)"}
        trace = episode.traces[0]
        if not trace.ok:
            last = trace.errors[-1] if trace.errors else None
            what = f"{last.type}: {last.message}" if last is not None else "no error recorded"
            return {"error": f"the rollout failed: {what}"[:2000]}
        return {"reward": trace.reward, "rewards": {k: (r.value if r is not None else None)
                                                    for k, r in trace.rewards.items()}}

    async def release(self, client) -> None:
        """Close the episode's own model client: the interception server keeps one per distinct
        client config (each episode's URL is one) until it stops."""
        server = self.env._interception
        found = getattr(server, "clients", {}).pop(client.model_dump_json(), None)
        if found is not None:
            await found.close()

    def keep(self, request: dict, episode) -> None:
        trace_dir = self.config.get("trace_dir")
        if not trace_dir:
            return
        path = Path(trace_dir) / f"traces-{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps({"url": request["url"], "episode": episode.model_dump(mode="json")}) + "\n")


if __name__ == "__main__":
    main()
