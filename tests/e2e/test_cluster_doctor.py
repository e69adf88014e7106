"""``prefect-ml doctor`` on the session's multi-node Ray cluster (:func:`tests.conftest.cluster`):
a row per alive node with what its workers import, its resources and devices, and storage
access measured on the node itself.

The tests in ``test_cluster.py`` kill node-a and add and kill node-c, so these assert on
whichever nodes are alive.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

import prefect_ml
from prefect_ml.integrations.compute import NodeReport, imported_versions, version_differences
from prefect_ml.tasks.doctor import node_checks, storage_host_checks
from tests.cluster import (
    ClusterNode,
    LocalCluster,
    bucket_keys,
    cli_environment,
    run_doctor,
)
from tests.conftest import REPO_ROOT
from tests.s3 import MotoS3

pytestmark = [pytest.mark.e2e, pytest.mark.cluster]

# What the doctor runs through on the driver: the probe of every node, as raw results.
PROBE_SCRIPT = """
import json
from dataclasses import asdict
from prefect_ml.integrations import compute, storage
from prefect_ml.integrations.settings import get_settings

settings = get_settings()
with compute.ray_session(settings):
    results = compute.probe_nodes(storage.root_url(settings), timeout_s=60)
    shipped = compute.ships_project()
nodes = [[record, asdict(report) if isinstance(report, compute.NodeReport) else repr(report)]
         for record, report in results]
print(json.dumps({"shipped": shipped, "driver": compute.imported_versions(), "nodes": nodes},
                 default=str))
"""


def _rows(output: str) -> list[list[str]]:
    """The doctor's table as ``[check, status, detail]`` rows, a cell's lines joined."""
    rows: list[list[str]] = []
    for line in output.splitlines():
        if not line.startswith("│"):
            continue
        name, status, detail = (cell.strip() for cell in line.strip("│").split("│"))
        if name:
            rows.append([name, status, detail])
        else:
            rows[-1][2] += "\n" + detail
    return rows


def _by_address(cluster: LocalCluster, addresses: set[str]) -> dict[str, ClusterNode]:
    """The alive node at each of Ray's node addresses, asserting there is one for each: the
    workers at their loopback IPs, the head at the one left (Ray gives it this host's)."""
    alive = [node for node in cluster.nodes if not node.ended]
    workers = {node.ip: node for node in alive if node.name != "head"}
    (head_address,) = addresses - set(workers)
    assert set(workers) <= addresses and len(addresses) == len(alive)
    return {**workers, head_address: next(node for node in alive if node.name == "head")}


def _node_without_credentials(cluster: LocalCluster) -> ClusterNode:
    """A node whose host reaches the S3 endpoint but has no S3 credentials."""
    environment = cluster.environment
    secrets = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    cluster.environment = {k: v for k, v in environment.items() if k not in secrets}
    try:
        return cluster.add_node("node-bare", "127.0.0.5", 0)
    finally:
        cluster.environment = environment


def test_doctor_probes_every_node_and_fails_only_the_one_without_credentials(
    cluster: LocalCluster, s3_bucket: str, moto_s3: MotoS3, tmp_path: Path
) -> None:
    """One row per alive node with the versions its workers import (prefect-ml shipped), its
    resources and its storage access; a node without S3 credentials fails its own row, naming
    the error, while every other row passes; the probe objects are deleted afterwards."""
    cluster.wait_for_nodes(cluster.alive_count())
    bare = _node_without_credentials(cluster)
    env = cli_environment(
        cluster, tmp_path / "home", f"{s3_bucket}/doctor", f"sqlite:///{tmp_path}/m.db"
    )
    try:
        result = run_doctor(env)
    finally:
        bare.stop()
        cluster.wait_for_nodes(cluster.alive_count())
    rows = _rows(result.stderr)  # the CLI's console writes to stderr
    assert result.returncode == 1, result.stderr[-6000:]
    failed = [row for row in rows if row[1] == "FAIL"]
    assert [row[0] for row in failed] == ["node 127.0.0.5"], result.stderr[-6000:]
    assert f"no S3 credentials for {s3_bucket}/doctor/.doctor/" in failed[0][2]

    ray_row = next(row for row in rows if row[0] == "ray")
    assert ray_row[1] == "ok" and "shipped prefect_ml" in ray_row[2]
    node_rows = {row[0].removeprefix("node "): row for row in rows if row[0].startswith("node ")}
    driver_content = imported_versions()["prefect-ml content"]
    assert node_rows.pop(bare.ip)
    for address, node in _by_address(cluster, set(node_rows)).items():
        name, status, detail = node_rows[address]
        assert status == "ok", detail
        assert (
            f"python {platform.python_version()}, ray {ray.__version__}, "
            f"torch {torch.__version__}, prefect-ml {prefect_ml.__version__} shipped "
            f"(content {driver_content}, from /"
        ) in detail
        expected = f"{node.cpus} CPU, 0 GPU" + "".join(
            f", {key} {value:g}" for key, value in sorted(node.resources.items())
        )
        assert f"\n{expected}\n" in detail
        assert "cpu: " in detail and "collective backend gloo" in detail
        assert "storage: written, read back and deleted; sees the driver's probe object" in detail
    assert not any(row[0] == "cluster storage" for row in rows), "S3 is shared storage"
    assert bucket_keys(moto_s3, "doctor/.doctor/") == [], "every probe object was deleted"


def test_file_storage_on_several_hosts_warns_and_version_differences_are_graded(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """The probe's real results from every node, with ``file://`` storage (a path all these
    nodes happen to share): the several-hosts warning, each node seeing the driver's object,
    prefect-ml imported from the shipped copy; then one version changed at a time."""
    cluster.wait_for_nodes(cluster.alive_count())
    storage_url = (tmp_path / "storage").as_uri()
    env = cli_environment(cluster, tmp_path / "home", storage_url, f"sqlite:///{tmp_path}/m.db")
    probe = subprocess.run(
        [sys.executable, "-c", PROBE_SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    found: dict[str, Any] = json.loads(probe.stdout.splitlines()[-1])
    assert found["shipped"] is True
    driver: dict[str, str] = found["driver"]
    records = [record for record, _ in found["nodes"]]
    assert _by_address(cluster, {record["NodeManagerAddress"] for record in records})
    reports = [NodeReport(**report) for _, report in found["nodes"]]

    (warning,) = storage_host_checks(storage_url, records)
    assert warning.ok and warning.warning and warning.name == "cluster storage"
    assert f"on {len(records)} hosts" in warning.detail and "s3://" in warning.detail
    assert storage_host_checks(storage_url, records[:1]) == [], "one host: nothing to warn"
    assert storage_host_checks("s3://bucket/prefect-ml", records) == []

    for record, report in zip(records, reports, strict=True):
        assert not Path(report.prefect_ml_from).is_relative_to(REPO_ROOT), "the shipped copy"
        assert report.versions == driver, "one venv for the driver and every node here"
        (row,) = node_checks(record, report, driver, prefect_ml_shipped=True)
        assert row.ok and "sees the driver's probe object" in row.detail

    record, report = records[0], reports[0]

    def differences(package: str, version: str, shipped: bool = True) -> list[tuple[str, bool]]:
        changed = {**report.versions, package: version}
        return [
            (difference.package, difference.fatal)
            for difference in version_differences(driver, changed, prefect_ml_shipped=shipped)
        ]

    assert differences("torch", "2.0.0") == [("torch", False)]
    assert differences("ray", "2.59.0") == [("ray", True)]
    major, minor, patch = driver["python"].split(".")
    assert differences("python", f"{major}.{minor}.{int(patch) + 1}") == [("python", False)]
    assert differences("python", f"{major}.{int(minor) + 1}.0") == [("python", True)]
    assert differences("prefect-ml", "0.0.1") == [], "the shipped copy is the driver's code"
    assert differences("prefect-ml", "0.0.1", shipped=False) == [("prefect-ml", True)]
    other_code = [("prefect-ml content", True)]
    assert differences("prefect-ml content", "0" * 12) == other_code, "shipped or not"
    assert differences("prefect-ml content", "0" * 12, shipped=False) == other_code

    older_torch = dataclasses.replace(report, versions={**report.versions, "torch": "2.0.0"})
    main, torch_row = node_checks(record, older_torch, driver, prefect_ml_shipped=True)
    assert main.ok and torch_row.ok and torch_row.warning
    assert torch_row.detail.startswith(f"WARNING: torch 2.0.0 on the node, {driver['torch']}")
    installed = dataclasses.replace(report, versions={**report.versions, "prefect-ml": "0.0.1"})
    _, prefect_ml_row = node_checks(record, installed, driver, prefect_ml_shipped=False)
    assert not prefect_ml_row.ok and "PREFECT_ML_SHIP_CODE=always" in prefect_ml_row.detail
    silent = TimeoutError("no answer within 60s")  # what on_each_node gives a silent node
    (row,) = node_checks(record, silent, driver, prefect_ml_shipped=True)
    assert not row.ok and row.name == f"node {record['NodeManagerAddress']}"
    assert "TimeoutError: no answer within 60s" in row.detail
