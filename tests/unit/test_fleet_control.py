"""The fleet's control surface without a run: `[fleet]` refused by field, the token-guarded
routes' refusals (orchestrator/run/fleet_keeper.py), `inflight fleet` with no live run, and the
per-engine statistics of `inflight stats`."""

from __future__ import annotations

import json
import os
import stat

import pytest

from orchestrator.errors import ConfigError


@pytest.mark.parametrize("field,value", [("drain_s", 0), ("min_engines_wait_s", -1), ("probe_s", 0),
                                         ("min_engines", -1)])
def test_a_bad_fleet_setting_is_refused_naming_it(field, value):
    with pytest.raises(ConfigError) as refused:
        _load(f"[fleet]\n{field} = {value}\n")
    assert refused.value.field == f"fleet.{field}"


def _load(text: str):
    import tempfile

    from orchestrator.config.run import load_config

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(text)
    try:
        return load_config(f.name)
    finally:
        os.unlink(f.name)


def test_servers_the_run_starts_drain_on_sigterm_for_fleet_drain_s():
    from orchestrator.engines.server import server_command

    config = _load('[fleet]\ndrain_s = 42.5\n[engine]\nkind = "server"\n')
    engine = config.engine_configs()[0][1]
    assert engine.shutdown_timeout_s == 43
    command = server_command(engine, 8000)
    assert command[command.index("--shutdown-timeout") + 1] == "43"


def client(token: str = "secret"):
    from starlette.applications import Starlette
    from starlette.testclient import TestClient

    from orchestrator.run.fleet_control import fleet_routes

    return TestClient(Starlette(routes=fleet_routes(lambda: None, token)))


def test_the_control_routes_need_the_token_and_name_a_bad_body():
    c = client()
    assert c.post("/fleet/engines", json={"url": "http://127.0.0.1:1"}).status_code == 401
    wrong = c.post("/fleet/engines", json={"url": "x"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["field"] == "Authorization"
    auth = {"Authorization": "Bearer secret"}
    bad = c.post("/fleet/engines", content=b"{not json", headers=auth)
    assert bad.status_code == 400 and bad.json()["field"] == "body"
    assert c.post("/fleet/engines", json={"URL": "x"}, headers=auth).json()["field"] == "url"
    extra = c.post("/fleet/engines", json={"url": "http://a:1", "model": "m"}, headers=auth)
    assert extra.status_code == 400 and extra.json()["field"] == "model"
    starting = c.post("/fleet/engines/engine-1/drain", headers=auth)
    assert starting.status_code == 503 and starting.json()["field"] == "run"
    assert c.get("/fleet").status_code == 503


def test_the_control_token_is_its_owners_only(tmp_path):
    from orchestrator.run.fleet_control import write_control_token

    path = write_control_token(tmp_path, "t0k")
    assert path.read_text().strip() == "t0k" and stat.S_IMODE(path.stat().st_mode) == 0o600


def test_inflight_fleet_without_a_live_run_is_exit_2_naming_run_dir(tmp_path, capsys):
    from orchestrator.commands.cli import main

    assert main(["fleet", "add", str(tmp_path), "http://127.0.0.1:1"]) == 2
    assert "RUN_DIR" in capsys.readouterr().err
    (tmp_path / "http.json").write_text(json.dumps({"url": "http://127.0.0.1:9"}))  # nobody listens
    assert main(["fleet", "drain", str(tmp_path), "engine-1", "--timeout", "5"]) == 2
    assert "does not answer" in capsys.readouterr().err


def test_stats_show_the_runs_fleet_history_and_skip_a_torn_line(tmp_path):
    from replay.query.fromlog import fleet_history

    assert fleet_history(tmp_path) is None  # a run without engines that came and went
    (tmp_path / "fleet.jsonl").write_text('{"engine": "engine-2", "state": "joining"}\n{"engine": "engine-2", '
                                          '"state": "serving"}\n{"torn')
    assert [h["state"] for h in fleet_history(tmp_path)] == ["joining", "serving"]


@pytest.mark.parametrize("extra,field", [
    ('[activation]\nkv_policy = "keep"\n', "activation.kv_policy"),
    ("[engine]\nmax_lora_rank = 32\n", "engine.max_lora_rank"),
    ("[engine]\nmax_loras = 4\n", "engine.max_loras"),
])
def test_a_knob_that_trainer_lora_replaces_is_refused_naming_it(extra, field):
    """#30: every knob takes effect or is refused naming the one that wins."""
    with pytest.raises(ConfigError) as refused:
        _load("[trainer.lora]\nrank = 8\n" + extra)
    assert refused.value.field == field and "lora" in refused.value.reason


def test_a_join_url_that_is_not_one_is_refused_naming_url():
    import anyio

    from orchestrator.run.fleet_keeper import FleetKeeper, FleetRefused

    keeper = FleetKeeper.__new__(FleetKeeper)  # its URL check needs no run
    for url in ("ftp://a:1", "http://", "http://a:notaport", ""):
        with pytest.raises(FleetRefused) as refused:
            anyio.run(keeper.add_url, url)
        assert refused.value.field == "url" and refused.value.status == 400


def test_a_resume_joins_again_the_servers_that_joined_by_url_and_had_not_left(tmp_path):
    """RUN_DIR/fleet.jsonl at the stop: engine-2 joined by URL and served, engine-3 joined and
    left, engine-4 joined and was lost, engine-1 came from the config; a torn last line."""
    from orchestrator.run.fleet_keeper import joined_urls

    def line(engine, source, state, url=None):
        return json.dumps({"at": 0.0, "engine": engine, "source": source, "state": state, "joined_at": 0.0,
                           "url": url}) + "\n"

    log = tmp_path / "fleet.jsonl"
    log.write_text(line("engine-0", "config", "serving") + line("engine-1", "config", "serving", "http://h:1")
                   + line("engine-2", "fleet add", "joining", "http://h:2") + line("engine-3", "fleet add", "joining", "http://h:3")
                   + line("engine-2", "fleet add", "serving", "http://h:2") + line("engine-3", "fleet add", "left", "http://h:3")
                   + line("engine-4", "fleet add", "fenced", "http://h:4") + line("engine-4", "fleet add", "lost", "http://h:4")
                   + line("engine-5", "fleet add", "fenced", "http://h:5") + '{"at": 1.0, "engi')
    assert joined_urls(log) == ["http://h:2", "http://h:5"]
    assert joined_urls(tmp_path / "none.jsonl") == []


def test_a_resumed_runs_new_engine_never_takes_an_id_the_log_already_names(tmp_path):
    """Records name engines by id: after a resume, a replacement or an engine past `count` must not
    be called engine-2 again when an engine of the earlier incarnation was."""
    from orchestrator.fleet.fleet import Fleet
    from orchestrator.run.fleet_keeper import logged_engine_ids

    log = tmp_path / "fleet.jsonl"
    log.write_text("".join(json.dumps({"engine": e, "state": "serving"}) + "\n"
                           for e in ("engine-0", "engine-1", "engine-2", "engine-4")) + '{"engine": "engine-9')
    assert logged_engine_ids(log) == {"engine-0", "engine-1", "engine-2", "engine-4"}
    assert logged_engine_ids(tmp_path / "none.jsonl") == set()

    class Idle:
        engine_id = ""

    fleet = Fleet([type("E", (Idle,), {"engine_id": e})() for e in ("engine-0", "engine-1")])
    assert fleet.new_engine_id() == "engine-2"  # a fresh run
    fleet.used_ids |= logged_engine_ids(log)
    assert fleet.new_engine_id() == "engine-3" and fleet.new_engine_id(reserved={"engine-3"}) == "engine-5"
