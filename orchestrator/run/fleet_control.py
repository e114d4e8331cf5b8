"""The run's fleet control routes (docs/fleet.md): `GET /fleet`, and the token-guarded
`POST /fleet/engines` and `POST /fleet/engines/{engine}/drain`, answered by the run's
`FleetKeeper`; the token is RUN_DIR/control.token, which `inflight fleet` reads."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec

from orchestrator.run.fleet_keeper import FleetKeeper, FleetRefused

# -- the control routes of the run's HTTP server ---------------------------------------------
CONTROL_TOKEN_FILE = "control.token"


def serve_fleet_control(run, app) -> None:
    """Add the routes to the run's app, with a new token in RUN_DIR/control.token. They answer
    503 until the run's fleet and scheduler exist."""
    import secrets

    token = secrets.token_urlsafe(24)
    write_control_token(run.run_dir, token)
    app.router.routes.extend(fleet_routes(lambda: getattr(getattr(run, "loop", None), "keeper", None)
                                          if getattr(run, "fleet", None) is not None
                                          and getattr(run, "scheduler", None) is not None else None, token))


def write_control_token(run_dir: Path, token: str) -> Path:
    """RUN_DIR/control.token, readable by its owner only: `inflight fleet` reads it."""
    import os

    path = Path(run_dir) / CONTROL_TOKEN_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return path


def fleet_routes(keeper: Callable[[], FleetKeeper | None], token: str) -> list:
    """GET /fleet (read-only); POST /fleet/engines {"url": ...} and POST
    /fleet/engines/{engine}/drain, each with `Authorization: Bearer <RUN_DIR/control.token>`."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from transports.pull import authorized

    def refused(status: int, field: str, reason: str) -> JSONResponse:
        return JSONResponse({"error": reason, "field": field}, status_code=status)

    def current() -> FleetKeeper:
        k = keeper()
        if k is None:
            raise FleetRefused(503, "run", "the run is starting: its fleet is not up yet")
        return k

    async def get_fleet(request: Request):
        try:
            k = current()
        except FleetRefused as exc:
            return refused(exc.status, exc.field, exc.reason)
        fleet = k.fleet
        return JSONResponse({"live_version": fleet.live_version, "counts": fleet.member_counts(),
                             "admission_paused": k.paused_why,
                             "engines": [msgspec.to_builtins(m) for m in fleet.members.values()]})

    async def mutate(request: Request, work) -> JSONResponse:
        if not authorized(request.headers.get("authorization"), token):
            return refused(401, "Authorization", f"missing or wrong token: send Authorization: Bearer <the "
                                                 f"contents of RUN_DIR/{CONTROL_TOKEN_FILE}>")
        try:
            return JSONResponse(await work(current()))
        except FleetRefused as exc:
            return refused(exc.status, exc.field, exc.reason)

    async def post_engine(request: Request):
        try:
            body = await request.json()
        except ValueError as exc:
            return refused(400, "body", f"must be a JSON object {{\"url\": ...}}: {exc}")
        if not isinstance(body, dict) or not isinstance(body.get("url"), str):
            return refused(400, "url", "the body must be a JSON object with a string \"url\"")
        unknown = sorted(set(body) - {"url"})
        if unknown:
            return refused(400, unknown[0], "unknown field; the body takes \"url\" only")
        return await mutate(request, lambda k: k.add_url(body["url"]))

    async def post_drain(request: Request):
        engine_id = request.path_params["engine"]
        return await mutate(request, lambda k: k.drain(engine_id))

    return [Route("/fleet", get_fleet, methods=["GET"]),
            Route("/fleet/engines", post_engine, methods=["POST"]),
            Route("/fleet/engines/{engine}/drain", post_drain, methods=["POST"])]
