"""The campaign's live view on Prefect's real API (the session's test server)."""

from __future__ import annotations

import threading
import uuid

from prefect import flow, get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
from prefect.runtime import flow_run

from prefect_ml.tasks.campaign.coordinator import Tally
from prefect_ml.tasks.campaign.results import TrialSummary
from prefect_ml.tasks.campaign.view import CampaignView, slug

BLOCKED_S = 30.0  # only a bound on a test that would otherwise hang


@flow
def _campaign_loop(campaign: str) -> tuple[str, bool, list[str]]:
    """What the coordinator's loop does with its view, with a leaderboard read that blocks
    until the loop has shown the view twice more: the flow run's id, whether the loop went on
    while the first write was blocked, and the threads that read the leaderboard."""
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    read_on: list[str] = []

    def rows() -> list[TrialSummary]:
        read_on.append(threading.current_thread().name)
        entered.set()
        release.wait(BLOCKED_S)
        done.set()
        return [TrialSummary(number=0, state="COMPLETE", values={"val_accuracy": 0.9}, params={})]

    tally = Tally()
    with CampaignView(campaign, 2, tally, rows=rows, links=dict) as view:
        view.show(force=False)
        assert entered.wait(BLOCKED_S)
        view.show(force=False)  # the first write is still blocked in rows(): skipped
        went_on = not done.is_set()
        release.set()
        tally.complete = 2
        view.show(force=True)
    return str(flow_run.id), went_on, read_on


def test_the_artifacts_are_written_off_the_loop_and_the_forced_view_shows_the_end() -> None:
    """A slow leaderboard read never holds the coordinator's loop (which feeds the workers);
    the artifacts still belong to the flow run; the forced view at the end is written before
    it returns, with the final count."""
    campaign = f"view-{uuid.uuid4().hex[:8]}"
    run_id, went_on, read_on = _campaign_loop(campaign)

    assert went_on
    assert len(read_on) == 2 and threading.current_thread().name not in read_on
    progress, leaderboard = (
        f"campaign-{slug(campaign)}-{kind}" for kind in ("progress", "leaderboard")
    )
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[progress, leaderboard]))
        )
    assert {a.key: a.data for a in found if a.key == progress} == {progress: 100.0}
    assert {str(a.flow_run_id) for a in found if a.key == leaderboard} == {run_id}
