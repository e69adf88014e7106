"""The whole process killed mid-training; the same command resumes from the last checkpoint.

The first command is issue 7's done-when command (bf16, FSDP over 2 workers, gradient
checkpointing through a user model's hook), with sharded checkpoints every 4 steps as well as
at epoch ends; the second resumes the same run on 1 DDP worker: the DCP checkpoint restores
across strategy, layout and worker count (from inside an epoch if the kill came after a
mid-epoch checkpoint), and the model registers.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import psutil

from prefect_ml.integrations import tracking, training
from prefect_ml.integrations.settings import PrefectMLSettings
from tests.conftest import REPO_ROOT
from tests.helpers import cli_env, committed_epochs, resume_point, wait_while_running

EPOCHS = 5
COMMAND = [
    sys.executable,
    "-m",
    "prefect_ml.flows.cli",
    "train",
    "--model",
    "tests.fixtures.user_code:slow_model",
    "--model-options",
    '{"delay": 0.05}',
    "--epochs",
    str(EPOCHS),
    "--precision",
    "bf16",
    "--checkpoint-every-steps",
    "4",
]
FIRST = [*COMMAND, "--strategy", "fsdp", "--gradient-checkpointing", "--workers", "2"]
SECOND = [*COMMAND, "--strategy", "ddp", "--workers", "1"]


def _kill_tree(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the CLI and everything it started (its local Ray included), like a lost machine."""
    try:
        root = psutil.Process(process.pid)
    except psutil.NoSuchProcess:  # it exited already (and was reaped): nothing left to kill
        return
    victims = [root, *root.children(recursive=True)]
    for victim in victims:
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=30)


def test_killed_process_resumes_from_last_verified_checkpoint(
    home: PrefectMLSettings, tmp_path: Path
) -> None:
    env = cli_env(home.home_dir, own_ray=True)
    log = (tmp_path / "first.log").open("wb")
    first = subprocess.Popen(FIRST, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    storage_dir = home.home_dir / "storage"
    try:
        wait_while_running(
            first,
            tmp_path / "first.log",
            lambda: 2 in committed_epochs(storage_dir),
            300,
            "the epoch-2 checkpoint",
        )
    finally:
        _kill_tree(first)
    assert max(committed_epochs(storage_dir)) < EPOCHS, "the process must die before training ends"
    # The newest checkpoint with weights: under the checkpoint budget, the mid-epoch checkpoints
    # spend it, so an epoch end may have committed its metrics only.
    killed_at = resume_point(storage_dir)

    second = subprocess.run(
        SECOND, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "Resuming MLflow run" in second.stderr + second.stdout

    client = tracking.client_for(home.resolved_tracking_uri)
    runs = client.search_runs(["1"])
    assert len(runs) == 1, "the second command continued the same MLflow run"
    run = runs[0]
    assert run.info.status == "FINISHED"
    resumed_from = int(run.data.tags["prefect_ml.resumed_from_epoch"])
    assert resumed_from >= killed_at >= 1, "resumed from the last checkpoint, not from epoch 0"
    assert tracking.logged_epochs(client, run.info.run_id) == list(range(1, EPOCHS + 1))
    assert run.data.tags["registered_version"] == "1"
    assert run.data.params["training.strategy"] == "fsdp", "the run began sharded"
    assert run.data.tags[training.WORLD_SIZE_TAG] == "1", "and finished on one worker"
    workers = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "workers")}
    assert workers[1] == 2 and workers[EPOCHS] == 1
    mid_epoch = client.get_metric_history(run.info.run_id, "mid_epoch_checkpoints")
    assert {m.step for m in mid_epoch if m.value > 0} == set(range(1, EPOCHS + 1))
    peaks = client.get_metric_history(run.info.run_id, "peak_memory_mib")
    assert len(peaks) == EPOCHS and all(p.value > 50 for p in peaks), "each worker's peak RSS"
    assert run.data.tags[training.PEAK_MEMORY_TAG].startswith("peak process RSS")
