"""The driver's view of a training run's epochs: each committed epoch logged to MLflow once,
and each worker group's record copied to the run's tags."""

from __future__ import annotations

import json
import threading
from types import TracebackType

from prefect import get_run_logger
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from prefect_ml.integrations import services, tracking, training
from prefect_ml.integrations.errors import CheckpointError
from prefect_ml.integrations.storage import CheckpointStore, Lease
from prefect_ml.integrations.training import METRICS_FILE


class EpochRecorder:
    """Logs each committed epoch to MLflow exactly once, and shows it (rich bar, log line).

    Workers only commit checkpoints, each holding its epoch's metrics; this driver-side poller
    turns verified checkpoints into the run's metric history. The checkpoint store is the source
    of truth, so epochs that a killed process committed but never logged are logged on resume,
    and no epoch is logged twice (this is the run's only metric writer: with ``lease``, it stops
    logging once the lease is lost to another driver). Each worker group's rank 0 records what
    the group is when it starts (its size, nodes, first epoch); the newest record becomes the
    run's tags here, so the workers never import MLflow nor need its address.
    """

    def __init__(
        self,
        tracking_uri: str,
        run_id: str,
        checkpoint_url: str,
        epochs: int,
        lease: Lease | None = None,
        headline: str = "val_accuracy",
        shown: tuple[str, ...] = (),
    ) -> None:
        self._client = tracking.client_for(tracking_uri)
        self._headline = headline  # the task's metric shown next to the loss
        self._shown = shown  # and what the model logged with prog_bar=True
        self._lease = lease
        self._run_id, self._epochs = run_id, epochs
        self._store = CheckpointStore(checkpoint_url)
        self._logged = set(tracking.logged_epochs(self._client, run_id))
        self._tagged_group = ""  # the newest worker group's record already on the run
        self._recorded_any = False  # whether this recorder logged an epoch yet
        self._logger = get_run_logger()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._progress = Progress(
            TextColumn("[bold]training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[metrics]}"),
            TimeElapsedColumn(),
        )
        self._bar = self._progress.add_task("epochs", total=epochs, metrics="")

    def __enter__(self) -> EpochRecorder:
        self._progress.start()
        self.record_new()
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
        self.record_new()
        self._progress.stop()

    def _poll(self) -> None:
        while not self._stop.wait(1.0):
            self.record_new()

    def record_new(self) -> None:
        """Log the epochs committed since, and tag the run with a new worker group."""
        self._tag_newest_worker_group()
        for epoch in self._store.epochs():
            if self._lease is not None and self._lease.lost:
                return
            if epoch in self._logged:
                continue
            try:
                metrics = json.loads(self._store.read_verified(epoch, METRICS_FILE))
            except CheckpointError:
                continue  # not committed yet; a later poll sees it
            tracking.log_epoch(
                self._client, self._run_id, epoch, metrics, self._store.url_for(epoch)
            )
            if not self._recorded_any:
                services.mark(f"epoch {epoch} committed (seen by the driver's 1 s poll)")
                self._recorded_any = True
            self._logged.add(epoch)
            shown = [
                "train_loss",
                *(name for name in (self._headline, *self._shown) if name != "train_loss"),
            ]
            values = "  ".join(f"{name} {metrics[name]:.4f}" for name in shown if name in metrics)
            line = f"{values}  {metrics['samples_per_second']:,.0f} samples/s"
            self._logger.info("epoch %d/%d  %s", epoch, self._epochs, line)
            self._progress.update(self._bar, completed=len(self._logged), metrics=line)

    def _tag_newest_worker_group(self) -> None:
        """Copy the newest worker group's record to the run's tags, once per new record (a
        group starts again after a lost worker and when an elastic group resizes)."""
        groups = self._store.worker_groups()  # oldest first
        if not groups or groups[-1] == self._tagged_group:
            return
        if self._lease is not None and self._lease.lost:
            return
        record = self._store.read_worker_group(groups[-1])
        tags = {name: value for name, value in record.items() if name in training.WORKER_GROUP_TAGS}
        tracking.set_tags(self._client, self._run_id, tags)
        self._tagged_group = groups[-1]
