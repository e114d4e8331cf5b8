"""Where the trainer computes: its cores and torch threads (`trainer.threads`, `trainer.cpus`).
Each case runs in a child process: pinning changes the affinity of the process that pins."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.light_lane  # passes at any pace: the light lane (tests/conftest.py)

CODE = """
import json, os, sys, torch
from orchestrator.config.run import TrainerConfig
from orchestrator.trainer.process import pin
tc = TrainerConfig(**json.loads(sys.argv[1])).validate()
cpus, threads = pin(tc, int(sys.argv[2]))
print(json.dumps({"cpus": sorted(cpus), "threads": threads, "torch": torch.get_num_threads(),
                  "affinity": sorted(os.sched_getaffinity(0))}))
"""


def pinned(local_ranks: int = 1, **trainer) -> dict:
    out = subprocess.run([sys.executable, "-c", CODE, json.dumps(trainer), str(local_ranks)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


AVAILABLE = sorted(os.sched_getaffinity(0))


def test_auto_takes_every_core_the_engines_included_a_share_per_rank():
    alone = pinned(threads="auto")
    assert alone["cpus"] == alone["affinity"] == AVAILABLE
    assert alone["threads"] == alone["torch"] == len(AVAILABLE)
    two = pinned(2, threads="auto")
    assert two["threads"] == two["torch"] == max(1, len(AVAILABLE) // 2)


@pytest.mark.skipif(len(AVAILABLE) < 2 or 0 not in AVAILABLE, reason="needs core 0 and another core")
def test_a_number_keeps_the_trainer_off_the_engines_core():
    out = pinned(threads=1)
    assert 0 not in out["affinity"] and out["affinity"] == [c for c in AVAILABLE if c != 0]
    assert out["torch"] == 1


def test_threads_must_be_positive_or_auto():
    from orchestrator.config.run import TrainerConfig
    from orchestrator.errors import ConfigError

    with pytest.raises(ConfigError, match="trainer.threads"):
        TrainerConfig(threads=0).validate()
    assert TrainerConfig(threads="auto").validate().threads == "auto"
