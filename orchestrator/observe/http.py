"""The live query server of `inflight run`: Starlette on uvicorn, inside the run's task group.

    GET /stats     the same JSON as `inflight stats --json` over the live run (same code);
                   ?step_min=&step_max= filter as the CLI's --step-min/--step-max do
    GET /metrics   Prometheus text (prometheus_client)
    GET /healthz   {"ok": true, "step": ..., "live_version": ...}; "ok": false with "degraded"
                   saying why while the run cannot make progress (activations failing)

The socket is bound before anything else starts (a port in use fails the run at once); while
the run starts, /stats and /metrics answer 503 (their callables return None) and /healthz says
"state": "starting".

Bound to 127.0.0.1 by default (`[http] host`); port 0 picks a free port, and the address is
written to RUN_DIR/http.json. A bad request gets a 4xx with a JSON body naming the parameter;
nothing a client sends can stop the run.
"""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator.observe.logging import get_logger

log = get_logger(__name__)


def build_app(stats: Callable[[Any], dict | None], metrics: Callable[[], bytes | None], health: Callable[[], dict]):
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    from replay.query import Filters

    def bad(parameter: str, reason: str) -> JSONResponse:
        return JSONResponse({"error": reason, "parameter": parameter}, status_code=400)

    def starting() -> JSONResponse:
        return JSONResponse({"error": "the run is starting"}, status_code=503)

    async def get_stats(request: Request):
        values: dict[str, int] = {}
        for name in ("step_min", "step_max"):
            raw = request.query_params.get(name)
            if raw is None or raw == "":
                continue
            try:
                values[name] = int(raw)
            except ValueError:
                return bad(name, f"must be an integer, got {raw!r}")
            if values[name] < 0:
                return bad(name, f"must be >= 0, got {values[name]}")
        unknown = sorted(set(request.query_params) - {"step_min", "step_max"})
        if unknown:
            return bad(unknown[0], "unknown query parameter; use step_min and step_max")
        try:
            filters = Filters(**values)
        except Exception as exc:  # noqa: BLE001 - a filter the query layer refuses is the client's error
            return bad(",".join(values) or "filters", str(exc))
        body = stats(filters)
        return starting() if body is None else JSONResponse(body)

    async def get_metrics(request: Request):
        body = metrics()
        if body is None:
            return starting()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def get_health(request: Request):
        return JSONResponse(health())

    return Starlette(routes=[Route("/stats", get_stats), Route("/metrics", get_metrics),
                             Route("/healthz", get_health)])


class HttpServer:
    def __init__(self, app, host: str, port: int, run_dir: Path) -> None:
        self.app, self.host, self.port, self.run_dir = app, host, port, Path(run_dir)
        self.url: str | None = None
        self._server = None

    def bind(self) -> socket.socket:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}" if family == socket.AF_INET else f"http://[{host}]:{port}"
        (self.run_dir / "http.json").write_text(json.dumps({"url": self.url}) + "\n")
        return sock

    async def serve(self, sock: socket.socket) -> None:
        import uvicorn

        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        server = uvicorn.Server(config)
        # The run owns SIGINT/SIGTERM (a graceful stop of every rollout): uvicorn must not.
        server.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
        self._server = server
        log.info("http.listening", url=self.url)
        try:
            await server.serve(sockets=[sock])
        finally:
            sock.close()

    def stop(self) -> None:
        """Ask the server to finish (it closes its socket and the serve task returns)."""
        if self._server is not None:
            self._server.should_exit = True
