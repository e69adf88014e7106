"""The pipeline on a real 3-node Ray cluster whose nodes cannot import the checkout.

The session's cluster (:func:`tests.conftest.cluster`): a head with no CPUs (it runs the
drivers' controllers) and two worker nodes of 1 CPU each at their own addresses, one of them
declaring a custom resource. The tests here kill and add nodes: node-a dies in the pipeline's
test and node-c joins there; the campaign's test kills the other worker node that is alive.
Storage is the S3 server and MLflow a tracking server, as on a real cluster; prefect-ml and the
tests' user code reach the nodes only by being shipped with each job.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import prefect_ml
from prefect_ml.integrations import tracking, training
from prefect_ml.integrations.compute import imported_versions
from tests.cluster import (
    WORKER_IPS,
    ClusterNode,
    LocalCluster,
    bucket_keys,
    cli_command,
    cli_environment,
    cli_process,
    run_doctor,
)
from tests.conftest import REPO_ROOT
from tests.e2e.test_fail_fast import WITHIN_S
from tests.helpers import free_port, latest_failed_flow_run_message, wait_for
from tests.s3 import MotoS3

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]


def _committed(moto_s3: MotoS3, prefix: str, epoch: int, runs: int = 1) -> bool:
    """Whether ``runs`` runs (or trials) under ``prefix`` have committed ``epoch``."""
    suffix = f"epoch-{epoch:06d}/MANIFEST.json"
    return sum(k.endswith(suffix) for k in bucket_keys(moto_s3, prefix)) >= runs


def _node(cluster: LocalCluster, name: str) -> ClusterNode:
    return next(node for node in cluster.nodes if node.name == name and not node.ended)


def _worker_node_besides(cluster: LocalCluster, ip: str) -> ClusterNode:
    """The one alive worker node other than the one at ``ip``: node-a when a test runs alone,
    node-c after the pipeline's test has killed node-a and added node-c."""
    (other,) = [
        node for node in cluster.nodes if node.name != "head" and node.ip != ip and not node.ended
    ]
    return other


def _runs(tracking_uri: str, experiment_name: str) -> list[Any]:
    client = tracking.client_for(tracking_uri)
    experiment = client.get_experiment_by_name(experiment_name)
    assert experiment is not None
    return list(client.search_runs([experiment.experiment_id]))


def _final_run(tracking_uri: str) -> Any:
    """The pipeline's final training run: the one a Ray Train group tagged (campaign trials
    train in one process here), or None before it started."""
    client = tracking.client_for(tracking_uri)
    experiment = client.get_experiment_by_name("cluster")
    if experiment is None:
        return None
    query = f"tags.`{training.WORLD_SIZE_TAG}` != ''"
    runs = client.search_runs([experiment.experiment_id], query)
    return runs[0] if runs else None


def _final_run_workers(tracking_uri: str) -> list[int]:
    """Workers per logged epoch of the pipeline's final training."""
    run = _final_run(tracking_uri)
    return _workers_per_epoch(tracking_uri, run.info.run_id) if run else []


def _latest_group_size(tracking_uri: str) -> str:
    run = _final_run(tracking_uri)
    return run.data.tags[training.WORLD_SIZE_TAG] if run else ""


def _workers_per_epoch(tracking_uri: str, run_id: str) -> list[int]:
    history = tracking.client_for(tracking_uri).get_metric_history(run_id, "workers")
    return [int(m.value) for m in sorted(history, key=lambda m: m.step)]


MODEL = ["--model", "tests.fixtures.user_code:slow_model"]
SEARCH = json.dumps({"lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True}})
EPOCHS = 10


@pytest.mark.entry_point("multi-node cluster")
def test_workers_asking_for_a_custom_resource_land_only_on_the_node_that_has_it(
    cluster: LocalCluster,
    tmp_path: Path,
    s3_bucket: str,
    mlflow_s3_server: str,
) -> None:
    """--worker-resources places the worker on node-b (fast_disk) though node-a is free; a
    resource no node has is refused before anything trains, naming the parameter."""
    env = cli_environment(cluster, tmp_path / "home", f"{s3_bucket}/placed", mlflow_s3_server)
    train = [
        *cli_command("train", "--experiment", "cluster-placed", "--epochs", "1"),
        *("--model-name", "cluster-placed", "--workers", "1"),
    ]
    placed = subprocess.run(
        [*train, "--worker-resources", '{"fast_disk": 1}'],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert placed.returncode == 0, placed.stdout[-3000:] + placed.stderr[-3000:]
    (run,) = _runs(mlflow_s3_server, "cluster-placed")
    assert run.data.tags[training.WORKER_NODES_TAG] == WORKER_IPS[1]
    assert run.data.tags[tracking.CODE_TAG].startswith("shipped prefect_ml")

    # Nothing of the checkout is importable on the nodes unless shipped.
    unshipped = subprocess.run(
        train,
        cwd=REPO_ROOT,
        env={**env, "PREFECT_ML_SHIP_CODE": "never"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert unshipped.returncode != 0
    message = " ".join((unshipped.stdout + unshipped.stderr).split())  # unwrap the console's lines
    for address in WORKER_IPS:
        listed = f"{address} ({prefect_ml.__version__} listed, not importable)"
        assert listed in message, message[-3000:]

    refused = subprocess.run(
        [*cli_command("sweep", "--n-trials", "2"), "--trial-resources", '{"nvme": 1}'],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0
    message = " ".join((refused.stdout + refused.stderr).split())
    assert "sweep.trial_resources" in message and "0 nvme in total" in message
    assert "--trial-resources" in message


def test_code_the_nodes_lack_ends_the_training_at_once_naming_the_nodes_and_the_fix(
    cluster: LocalCluster, tmp_path: Path, s3_bucket: str, mlflow_s3_server: str
) -> None:
    """Issue 37's case: the model needs code that the driver has (the checkout's
    ``examples.sequence``) and the nodes lack (not shipped; the folder hidden there). Every
    worker fails the same way; the run ends within a minute of its start naming each failing
    worker's node, the module and the fixes, in the command's output and the flow run's state
    message. Before, Ray Train restarted the worker group for ever (controller_failure_limit -1)."""
    env = cli_environment(cluster, tmp_path / "home", f"{s3_bucket}/lacking", mlflow_s3_server)
    train = cli_command("train", "--experiment", "cluster-lacking", "--epochs", "1")
    train += ["--workers", "2", "--model", "tests.fixtures.worker_faults:"]
    train[-1] += "model_importing_a_package_the_nodes_lack"
    train += ["--model-options", json.dumps({"module": "examples.sequence"})]
    run = subprocess.run(train, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    ended = time.time()

    output = " ".join((run.stdout + run.stderr).split())  # unwrap the console's lines
    assert run.returncode == 1, output[-3000:]
    reason = "ModuleNotFoundError: No module named 'examples.sequence'"
    fixes = ("pip install", "PREFECT_ML_SHIP_CODE=always", "PREFECT_ML_ALLOWED_MODULES")
    for expected in (reason, *fixes, "not retried"):
        assert expected in output, output[-3000:]
    named = set(re.findall(r"worker rank \d on node (\S+): ModuleNotFoundError", output))
    assert named and named <= {node.ip for node in cluster.nodes}, output[-3000:]
    assert reason in latest_failed_flow_run_message()
    (failed,) = _runs(mlflow_s3_server, "cluster-lacking")
    assert failed.info.status == "FAILED"
    seconds = ended - failed.info.start_time / 1000
    print(f"prefect-ml train ended {seconds:.1f} s after its training run started")
    assert seconds < WITHIN_S, f"ended {seconds:.0f} s after its training run started"


def test_the_pipeline_runs_on_the_cluster_and_survives_a_lost_node(
    cluster: LocalCluster,
    tmp_path: Path,
    s3_bucket: str,
    moto_s3: MotoS3,
    mlflow_s3_server: str,
) -> None:
    """Sweep, elastic training and serving on nodes that import nothing of the checkout. A
    worker node is killed mid-training: the group restarts on the other node from its last
    checkpoint; a node joins and the group grows onto it at Ray's next resize check. Every
    epoch is logged once."""
    env = cli_environment(cluster, tmp_path / "home", f"{s3_bucket}/prefect-ml", mlflow_s3_server)
    # Right after the loss Ray Train still counts the lost node and asks for 2 workers; it
    # decides again once this runs out (Ray's default 60 s). 10 s was too short on a loaded CI
    # machine once: the restart failed with WorkerGroupStartupTimeoutError.
    env["PREFECT_ML_WORKER_GROUP_START_TIMEOUT_S"] = "20"
    # The model's gate (a file on this host's /tmp, which the nodes share) holds the training
    # while the new node joins, so the group has grown before the epochs run out, however slow
    # the machine is.
    gate = tmp_path / "gate"
    waiting = tmp_path / "gate.waiting"  # the model creates it when it waits at the gate
    gate.touch()
    command = cli_command(
        "run",
        "--experiment",
        "cluster",
        "--model-name",
        "cluster-digits",
        *MODEL,
        "--model-options",
        json.dumps({"delay": 0.1, "gate": str(gate)}),
        "--workers",
        "1-2",
        "--elastic-resize-s",
        "2",
        "--epochs",
        str(EPOCHS),
        "--batch-size",
        "64",
        "--campaign",
        "cluster-search",
        "--n-trials",
        "2",
        "--concurrency",
        "2",
        "--sampler",
        "random",
        "--search-space",
        SEARCH,
        "--serve",
        "--port",
        str(free_port()),
        "--replica-cpus",
        "0.25",
    )
    log_path = tmp_path / "run.log"
    with cli_process(command, env, log_path) as run:
        wait_for(
            lambda: run.poll() is not None or _committed(moto_s3, "prefect-ml/checkpoints/", 2),
            600,
            "the final training's epoch-2 checkpoint",
        )
        assert run.poll() is None, log_path.read_text()[-5000:]
        _node(cluster, "node-a").kill()
        wait_for(
            lambda: run.poll() is not None or 1 in _final_run_workers(mlflow_s3_server),
            300,
            "an epoch trained by the one worker left",
        )
        gate.unlink()  # the one worker left stops at its next batch
        wait_for(lambda: run.poll() is not None or waiting.exists(), 120, "the worker to wait")
        assert _latest_group_size(mlflow_s3_server) == "1"
        cluster.add_node("node-c", "127.0.0.4", 1)
        # At Ray's next resize check the group restarts from the last checkpoint with a worker
        # on the new node (its rank 0 tags the group's size); then the gate opens.
        wait_for(
            lambda: run.poll() is not None or _latest_group_size(mlflow_s3_server) == "2",
            300,
            "the group to grow onto the new node",
        )
        gate.touch()
        wait_for(
            lambda: run.poll() is not None or "Serving until Ctrl-C" in log_path.read_text(),
            600,
            "the pipeline to serve",
        )
        assert run.poll() is None, log_path.read_text()[-5000:]
        run.send_signal(signal.SIGTERM)
        returncode = run.wait(timeout=120)
    output = log_path.read_text()
    assert returncode == 128 + signal.SIGTERM, output[-6000:]  # a stopped command's status
    assert "shipped prefect_ml" in output and "tests (" in output, "the code was shipped"

    runs = _runs(mlflow_s3_server, "cluster")
    trials = [r for r in runs if tracking.NODE_TAG in r.data.tags]
    assert len(trials) == 2
    assert {r.data.tags[tracking.NODE_TAG] for r in trials} == set(WORKER_IPS), "both nodes"
    final = next(r for r in runs if r.data.tags.get("registered_version"))
    client = tracking.client_for(mlflow_s3_server)
    assert tracking.logged_epochs(client, final.info.run_id) == list(range(1, EPOCHS + 1))
    workers = _workers_per_epoch(mlflow_s3_server, final.info.run_id)
    assert workers[0] == 2 and 1 in workers, f"two nodes' workers, then the survivor's: {workers}"
    assert workers[-1] == 2, f"grew onto the node that joined: {workers}"
    tags = final.data.tags
    assert int(tags[training.STARTED_AT_TAG]) > 3, "restarted twice from checkpoints"
    assert tags[training.WORKER_NODES_TAG].split(",") in (
        [WORKER_IPS[1], "127.0.0.4"],
        ["127.0.0.4", WORKER_IPS[1]],
    ), "the survivor and the new node, not the lost one"
    assert "POST /predict 200" in output, "the served model answered the smoke request"


def test_a_campaign_runs_the_trials_of_a_lost_node_again_from_their_checkpoints(
    cluster: LocalCluster,
    tmp_path: Path,
    s3_bucket: str,
    moto_s3: MotoS3,
    mlflow_s3_server: str,
) -> None:
    """A node running a trial is killed: the trial runs again, from its checkpoint, on the
    node that is left (node-b), and the campaign completes its budget there. The node killed is
    whichever other worker node is alive, so the test also passes run alone."""
    env = cli_environment(cluster, tmp_path / "home", f"{s3_bucket}/sweep", mlflow_s3_server)
    command = cli_command(
        "sweep",
        "--experiment",
        "cluster-sweep",
        *MODEL,
        "--model-options",
        '{"delay": 0.05}',
        "--epochs",
        "3",
        "--batch-size",
        "64",
        "--campaign",
        "lost-node",
        "--n-trials",
        "3",
        "--concurrency",
        "2",
        "--sampler",
        "random",
        "--search-space",
        SEARCH,
    )
    log_path = tmp_path / "sweep.log"
    with cli_process(command, env, log_path) as sweep:
        wait_for(
            lambda: sweep.poll() is not None or _committed(moto_s3, "sweep/campaigns/", 1, runs=2),
            300,
            "both running trials' first checkpoints",
        )
        _worker_node_besides(cluster, WORKER_IPS[1]).kill()
        returncode = sweep.wait(timeout=300)
    output = log_path.read_text()
    assert returncode == 0, output[-6000:]
    trials = [
        r for r in _runs(mlflow_s3_server, "cluster-sweep") if tracking.NODE_TAG in r.data.tags
    ]
    finished = [r for r in trials if r.info.status == "FINISHED"]
    assert len(finished) == 3, "the budget completed"
    retried = [r for r in finished if tracking.RESUMED_TAG in r.data.tags]
    assert retried, "the lost trial ran again from its checkpoint"
    assert all(r.data.tags[tracking.NODE_TAG] == WORKER_IPS[1] for r in retried)
    assert "runs again" in output


def test_a_node_with_a_partial_copy_at_the_drivers_path_trains_the_shipped_code(
    cluster: LocalCluster,
    tmp_path: Path,
    s3_bucket: str,
    mlflow_s3_server: str,
) -> None:
    """A node that sees the checkout's ``prefect_ml/`` folder at the driver's path, its
    subpackages missing (a host sharing a filesystem with a partial or older copy), runs the
    shipped prefect-ml: Ray puts the driver's working directory ahead of the shipped packages on
    every worker's path, and before the worker setup hook pinned them, every worker there failed
    with ``No module named 'prefect_ml.integrations...'``. The doctor's row for every node, that
    one too, shows the shipped copy with the driver's content hash."""
    stale = cluster.add_node(
        "node-stale", "127.0.0.6", 1, {"stale_copy": 1}, visible=["prefect_ml"]
    )
    env = cli_environment(cluster, tmp_path / "home", f"{s3_bucket}/stale", mlflow_s3_server)
    try:
        result = subprocess.run(
            [
                *cli_command("train", "--experiment", "cluster-stale", "--epochs", "1"),
                *("--model-name", "cluster-stale", "--workers", "1"),
                *("--worker-resources", '{"stale_copy": 1}'),
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
        nodes = cluster.alive_count()  # the stale node among them
        doctor = run_doctor(env)
    finally:
        stale.stop()
        cluster.wait_for_nodes(cluster.alive_count())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (run,) = _runs(mlflow_s3_server, "cluster-stale")
    assert run.data.tags[training.WORKER_NODES_TAG] == "127.0.0.6"
    assert run.data.tags[tracking.CODE_TAG].startswith("shipped prefect_ml")

    assert doctor.returncode == 0, doctor.stderr[-6000:]
    assert "node 127.0.0.6" in doctor.stderr
    shipped = f"shipped (content {imported_versions()['prefect-ml content']}, from /tmp/ray/"
    assert doctor.stderr.count(shipped) == nodes, doctor.stderr[-6000:]
