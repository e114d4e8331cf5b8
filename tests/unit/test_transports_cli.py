"""`inflight plan`: the worked example, JSON keys, bad input; registration stays light."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from transports import cli


def run(argv, capsys):
    parser = argparse.ArgumentParser(prog="inflight")
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench").add_subparsers(dest="bench_command", required=True)
    cli.register(sub, bench)
    args = parser.parse_args(argv)
    code = args.func(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_worked_example(capsys):
    code, out, _ = run(["plan", "--params", "32e9", "--dtype", "bf16", "--bandwidth", "2", "--step-seconds", "300",
                        "--json"], capsys)
    result = json.loads(out)
    assert code == 0
    assert result["transfer_seconds"] == pytest.approx(64.0)
    assert result["stale_fraction"] == pytest.approx(0.213, abs=0.001)


def test_parallel_links(capsys):
    code, out, _ = run(["plan", "--params", "32e9", "--bandwidth", "8x45", "--step-seconds", "300", "--json"], capsys)
    assert json.loads(out)["transfer_seconds"] == pytest.approx(0.178, abs=0.001)


def test_measured_bandwidth_reads_bench_results(capsys, tmp_path):
    results = tmp_path / "bench.json"
    results.write_text(json.dumps({"transports": {"ipc": {"gbps": 4.0}, "http": {"gbps": 1.0}}}))
    code, out, _ = run(["plan", "--params", "1e9", "--bandwidth", "measured", "--step-seconds", "10",
                        "--results", str(results), "--json"], capsys)
    result = json.loads(out)
    assert result["transfer_seconds"] == pytest.approx(0.5) and result["bandwidth_source"] == "ipc"


@pytest.mark.parametrize("argv,flag", [
    (["--params", "lots", "--bandwidth", "2", "--step-seconds", "300"], "--params"),
    (["--params", "1e9", "--bandwidth", "-2", "--step-seconds", "300"], "--bandwidth"),
    (["--params", "1e9", "--bandwidth", "2", "--step-seconds", "0"], "--step-seconds"),
    (["--params", "1e9", "--dtype", "int3", "--bandwidth", "2", "--step-seconds", "1"], "--dtype"),
    (["--params", "1e9", "--bandwidth", "measured", "--step-seconds", "1", "--results", "/nonexistent.json"],
     "--bandwidth")])
def test_bad_input_names_the_flag(argv, flag, capsys):
    code, _, err = run(["plan", *argv], capsys)
    assert code == 2
    assert err.startswith(f"inflight: error: {flag}")


def test_bench_rejects_a_round_count_below_one(capsys):
    code, _, err = run(["bench", "transports", "--rounds", "0"], capsys)
    assert code == 2 and err.startswith("inflight: error: --rounds")


def test_bench_rejects_unknown_transport(capsys):
    code, _, err = run(["bench", "transports", "--transports", "pigeon"], capsys)
    assert code == 2 and "--transports" in err


def test_registration_does_not_import_torch():
    code = "import sys, argparse; from transports import cli; p = argparse.ArgumentParser(); s = p.add_subparsers(); " \
           "cli.register(s, s.add_parser('bench').add_subparsers()); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("error", [
    "TransportTimeoutError", "TransportError", "ChecksumError", "TransportUnavailableError"])
def test_a_transport_error_in_bench_exits_2_with_one_named_line(error, capsys, monkeypatch, tmp_path):
    from transports import errors
    from transports.bench import transports as bench

    def failing(**kwargs):
        cls = getattr(errors, error)
        if error == "TransportTimeoutError":
            raise cls("waiting for an engine to connect", 1.5)
        if error == "ChecksumError":
            raise cls("model.w", "checksum 0x1 != sent 0x2")
        raise cls("the engine process died\nwith a second line")

    monkeypatch.setattr(bench, "run_bench", failing)
    code, out, err = run(["bench", "transports", "--size", "1MiB", "--save", str(tmp_path / "b.json")], capsys)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"inflight: error: {error}: ")
    assert "Traceback" not in err
    assert not (tmp_path / "b.json").exists()


def test_the_top_level_cli_exits_2_on_a_transport_error(tmp_path):
    """Through `inflight`'s own entry point in a child process; the failure is injected by a
    `sitecustomize` on the child's path that replaces `run_bench`."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import transports.bench.transports as b\n"
        "from transports.errors import TransportTimeoutError\n"
        "def run_bench(**kw):\n"
        "    raise TransportTimeoutError('waiting for an engine to connect', 1.5)\n"
        "b.run_bench = run_bench\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.getcwd()])}
    out = subprocess.run([sys.executable, "-m", "orchestrator.commands.cli", "bench", "transports", "--size", "1MiB",
                          "--save", ""], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith("inflight: error: TransportTimeoutError: ")
    assert "Traceback" not in out.stderr
