"""The two test tiers, applied by rule at collection (tests/README.md lists what each holds).

- ``make test`` (``-m "not full"``): every unit and contract test, plus one end-to-end test per
  way a user enters the product, each marked ``entry_point("<one of ENTRY_POINTS>")``.
- ``make test-all``: everything (chaos runs stay out of both, tests/chaos/conftest.py).

The rule: every test under tests/e2e/ is ``e2e``; an ``e2e`` test that is not an entry point
goes to the full tier, and so does a test marked ``full`` where it is written: outside tests/e2e/,
only scenarios of tens of seconds each (a killed worker or writer, a lost lease, an elastic
group losing a worker, injected S3 faults, distributed pruning, the GPU check's CPU run), with
the reason beside the mark. A new test therefore always lands in a tier: in ``make test`` unless
it is an end-to-end scenario beyond the entry points.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ENTRY_POINTS = {
    "prefect-ml run, cold": "its own local Ray and ephemeral Prefect API, as a newcomer gets it",
    "deployment on a worker": "prefect deploy, a real `prefect worker` runs the nightly flow",
    "UI form": "a training submitted from the Prefect UI's form in headless Chromium",
    "sweep killed and resumed": "a campaign SIGKILLed mid-way resumes to exactly N trials",
    "serve and roll": "serve @champion, move the alias, redeploy with no failed request",
    "S3 storage": "the pipeline with a sweep, every byte on the S3 server, MLflow's too",
    "multi-node cluster": "a training placed by resource on one node of the 3-raylet cluster",
}

_E2E = Path(__file__).parent / "e2e"


def apply(items: list[pytest.Item]) -> None:
    """Mark each item with its tier; an unknown entry-point name fails the collection."""
    for item in items:
        entry = item.get_closest_marker("entry_point")
        if entry is not None and entry.args[0] not in ENTRY_POINTS:
            raise pytest.UsageError(
                f"{item.nodeid}: entry_point({entry.args[0]!r}) is not one of "
                f"{sorted(ENTRY_POINTS)} (tests/tiers.py)"
            )
        if _E2E in Path(item.path).parents:
            item.add_marker(pytest.mark.e2e)
            if entry is None:
                item.add_marker(pytest.mark.full)
