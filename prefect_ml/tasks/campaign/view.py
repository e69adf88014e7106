"""A running campaign as people see it: a rich progress bar here, artifacts in Prefect."""

from __future__ import annotations

import contextvars
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from prefect.artifacts import (
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prefect_ml.tasks.campaign.coordinator import Tally
from prefect_ml.tasks.campaign.results import TrialSummary

if TYPE_CHECKING:
    from uuid import UUID

LEADERBOARD_INTERVAL_S = 3.0


class CampaignView:
    """The live view: a rich progress bar here, progress and leaderboard artifacts in Prefect.

    The artifacts are written by a thread of their own (in the caller's Prefect context, so
    they belong to its run): reading the study and calling Prefect's API take tens of
    milliseconds, which the coordinator's loop would otherwise spend with a worker idle.
    """

    def __init__(
        self,
        campaign: str,
        total: int | None,
        tally: Tally,
        rows: Callable[[], list[TrialSummary]],
        links: Callable[[], dict[int, str]],
    ) -> None:
        self.campaign, self.total, self.tally = campaign, total, tally
        self._rows, self._links = rows, links
        self._progress = Progress(
            TextColumn(f"[bold]campaign {campaign}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
        )
        self._bar = self._progress.add_task("trials", total=total, status="")
        self._artifact_id: UUID = create_progress_artifact(  # type: ignore[assignment]
            0.0, key=f"campaign-{slug(campaign)}-progress", description=f"campaign {campaign}"
        )
        self._last_leaderboard = 0.0
        self._publisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="campaign-view")
        self._published: Future[None] | None = None  # the latest artifacts' write

    def __enter__(self) -> CampaignView:
        self._progress.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._progress.stop()
        self._publisher.shutdown(wait=True)

    def show(self, *, force: bool) -> None:
        """The bar now; the artifacts at most every few seconds (skipped while the last write is
        still going), written in the background, unless ``force``: then they are written before
        this returns. A failed write raises here, at the next call that writes."""
        tally = self.tally
        best = "-" if tally.best is None else f"{tally.best:.4f}"
        status = (
            f"best {best}  complete {tally.complete}  pruned {tally.pruned}  failed {tally.failed}"
        )
        self._progress.update(self._bar, completed=tally.finished, status=status)
        now = time.monotonic()
        busy = self._published is not None and not self._published.done()
        if not force and (busy or now - self._last_leaderboard < LEADERBOARD_INTERVAL_S):
            return
        self._last_leaderboard = now
        if self._published is not None:
            self._published.result()
        context = contextvars.copy_context()
        self._published = self._publisher.submit(context.run, self._publish, tally.finished)
        if force:
            self._published.result()

    def _publish(self, finished: int) -> None:
        """The progress artifact at ``finished`` trials, and the leaderboard."""
        if self.total:
            update_progress_artifact(self._artifact_id, min(100.0, 100.0 * finished / self.total))
        rows, links = self._rows(), self._links()
        if rows:
            create_table_artifact(
                [leaderboard_row(row, links.get(row.number, "")) for row in rows],
                key=f"campaign-{slug(self.campaign)}-leaderboard",
                description=f"Top {len(rows)} trials of campaign {self.campaign}",
            )


def slug(name: str) -> str:
    """A Prefect artifact key from a campaign name (lowercase letters, digits, dashes)."""
    return "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-") or "campaign"


def leaderboard_row(row: TrialSummary, link: str) -> dict[str, Any]:
    return {
        "trial": row.number,
        "state": row.state,
        **{name: round(value, 6) for name, value in row.values.items()},
        "params": ", ".join(f"{k}={short(v)}" for k, v in sorted(row.params.items())),
        "mlflow_run": link,
    }


def short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
