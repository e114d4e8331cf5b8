"""`inflight fleet add|drain|list RUN_DIR ...`: change a running run's fleet (docs/fleet.md).

They talk to the run's HTTP server (its address in RUN_DIR/http.json, the token of its control
routes in RUN_DIR/control.token) and wait for the change to be done: `add` until the engine
serves the live version (or is refused, naming the field), `drain` until it has left.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from orchestrator.errors import ConfigError


def register(sub) -> None:
    fleet = sub.add_parser("fleet", help="add, drain or list the engines of a running run",
                           description="Change the fleet of a run while it runs: an engine server joins "
                                       "(brought to the live version first) or leaves (its rollouts finish).")
    actions = fleet.add_subparsers(dest="fleet_command", metavar="ACTION", required=True)
    add = actions.add_parser("add", help="a vLLM server (started with the run's model and "
                                         "--worker-extension-cls transports.swap.SwapWorkerExtension) joins")
    add.add_argument("run_dir", metavar="RUN_DIR")
    add.add_argument("url", metavar="URL", help="the server's base URL, e.g. http://127.0.0.1:8001")
    drain = actions.add_parser("drain", help="an engine takes no new rollouts, finishes its own, and leaves")
    drain.add_argument("run_dir", metavar="RUN_DIR")
    drain.add_argument("engine", metavar="ENGINE", help="its id, e.g. engine-1 (see: inflight fleet list)")
    listing = actions.add_parser("list", help="every engine the run has had: state, versions, rollouts")
    listing.add_argument("run_dir", metavar="RUN_DIR")
    for p in (add, drain, listing):
        p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the run's answer")
        p.add_argument("--json", action="store_true", help="print the run's JSON answer")
    fleet.set_defaults(func=cmd_fleet)


def cmd_fleet(args: argparse.Namespace) -> int:
    url, token = _control(Path(args.run_dir))
    if args.fleet_command == "add":
        answer = _call("POST", f"{url}/fleet/engines", token, args.timeout, {"url": args.url})
        line = f"{answer['engine']}\tserving version {answer['version']} (caught up in {answer['catch_up_s']}s)"
    elif args.fleet_command == "drain":
        answer = _call("POST", f"{url}/fleet/engines/{args.engine}/drain", token, args.timeout)
        line = f"{answer['engine']}\tleft" + (f" ({answer['aborted']} rollouts aborted past fleet.drain_s)"
                                             if answer.get("aborted") else "")
    else:
        answer = _call("GET", f"{url}/fleet", None, args.timeout)
        line = "\n".join(f"{m['engine']}\t{m['state']}\t{m['source']}\tversions {m['first_version']}.."
                         f"{m['last_version']}\trollouts {m['rollouts']}\ttokens {m['tokens']}"
                         f"{chr(9) + m['url'] if m.get('url') else ''}" for m in answer["engines"])
    print(json.dumps(answer) if args.json else line)
    return 0


def _control(run_dir: Path) -> tuple[str, str | None]:
    try:
        url = json.loads((run_dir / "http.json").read_text())["url"]
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError("RUN_DIR", f"{run_dir} has no live run's address (http.json: {exc}); is `inflight run "
                                     "--run-dir` running there with [http] enabled?") from None
    try:
        token = (run_dir / "control.token").read_text().strip()
    except OSError:
        token = None
    return url, token


def _call(method: str, url: str, token: str | None, timeout: float, body: dict | None = None) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        response = httpx.request(method, url, json=body, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise ConfigError("RUN_DIR", f"the run does not answer at {url} ({type(exc).__name__}: {exc}); is it "
                                     "still running?") from None
    try:
        answer = response.json()
    except ValueError:
        answer = {"error": response.text[:300]}
    if response.status_code >= 400:
        raise ConfigError(answer.get("field") or "fleet", answer.get("error") or f"HTTP {response.status_code}")
    return answer
