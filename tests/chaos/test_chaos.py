"""Each chaos scenario of ``benchmarks/chaos.py`` with a kill or two, and no invariant violated.

The checkpoint-upload kills (seconds) run by default. The others run the CLI on a Ray head and
a Prefect server of their own, a minute or more per kill, so they are marked ``chaos`` and run
with ``-m chaos``; ``make chaos`` runs the long version (50 kills per scenario). The seed is
random (``CHAOS_SEED`` replays one) and every failure names it.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks import chaos

SEED = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**31))


def _run(name: str, shared: chaos.Services, kills: int) -> None:
    tally = chaos.run_scenario(name, shared, random.Random(f"{SEED}:{name}"), kills, SEED)
    assert tally.kills >= kills
    assert tally.violations == [], f"CHAOS_SEED={SEED}: {tally.violations}"


@pytest.mark.full  # a writer SIGKILLed mid-upload and rerun, 25-42 s (tests/tiers.py)
def test_checkpoint_writer_killed_mid_upload(tmp_path: Path) -> None:
    with chaos.services(tmp_path, cluster=False) as shared:
        _run("upload-kill", shared, kills=2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[chaos.Services]:
    with chaos.services(tmp_path_factory.mktemp("chaos"), cluster=True) as shared:
        yield shared


@pytest.mark.chaos
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("scenario", ["train-kill", "sweep-kill", "worker-kill", "s3-faults"])
def test_scenario_survives_a_kill(scenario: str, cluster: chaos.Services) -> None:
    _run(scenario, cluster, kills=1)
