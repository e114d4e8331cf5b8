"""The run's weight server: `GET /weights/vNNNNNNNN/{file}` on the run's HTTP server, from which
engines on other hosts pull each committed version (`transports.pull`, the receiving end).

Token-guarded (a per-run secret handed to each engine worker in its `swap_init`); only committed
versions and the names a version directory holds are served (`transports.pull.serve_path`)."""

from __future__ import annotations

from pathlib import Path

from transports.pull import WEIGHTS_PREFIX, authorized, serve_path


def weights_routes(root: Path, token: str) -> list:
    from starlette.requests import Request
    from starlette.responses import FileResponse, JSONResponse
    from starlette.routing import Route

    async def get_file(request: Request):
        if not authorized(request.headers.get("authorization"), token):
            return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)
        path = serve_path(root, request.path_params["version"], request.path_params["name"])
        if path is None:
            return JSONResponse({"error": "no such committed version file"}, status_code=404)
        return FileResponse(path, media_type="application/octet-stream")

    return [Route(WEIGHTS_PREFIX + "/{version}/{name}", get_file)]
