"""The flow-start placement check on the real local Ray (2 CPUs, no GPU)."""

from __future__ import annotations

import logging

import pytest

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.services import run_logger
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import (
    CampaignParams,
    PipelineParams,
    ServingParams,
    TrainingParams,
    TrainModelParams,
)
from prefect_ml.tasks.placement import check_placement, require_fits, require_one_gpu_type


def test_requests_that_fit_pass_and_each_section_is_checked(
    home: PrefectMLSettings, ray_cluster: None
) -> None:
    check_placement(TrainModelParams())  # 2 workers x 1 CPU on 2 CPUs
    check_placement(TrainModelParams(training={"workers": "2-8"}))  # elastic: the minimum counts
    with pytest.raises(ConfigurationError) as caught:
        check_placement(TrainModelParams(training={"workers": 3}))
    assert caught.value.field == "training.cpus_per_worker"
    assert "3 worker(s) x (1 CPU) asked" in str(caught.value)
    assert "(--cpus-per-worker, --workers)" in str(caught.value)
    # A campaign alone trains no final model: its training section places nothing.
    check_placement(CampaignParams(training={"workers": 3}))
    with pytest.raises(ConfigurationError) as caught:
        check_placement(CampaignParams(sweep={"trial_workers": 2, "trial_cpus": 1.5}))
    assert caught.value.field == "sweep.trial_cpus"
    assert "2 trial worker(s) x (1.5 CPU) asked" in str(caught.value)
    with pytest.raises(ConfigurationError) as caught:
        check_placement(PipelineParams(serving={"replica_memory_gb": 10_000, "replica_cpus": 0.5}))
    assert caught.value.field == "serving.replica_memory_gb"
    assert "GB memory in total" in str(caught.value)


def test_with_the_check_off_an_impossible_request_only_warns(
    home: PrefectMLSettings,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An autoscaling cluster adds nodes when asked: the check must not refuse what it lacks."""
    nodes = [{"CPU": 2.0}]
    serving = ServingParams(replica_gpus=1, replica_accelerator_type="H100")
    with pytest.raises(ConfigurationError, match="PREFECT_ML_CHECK_RESOURCES=false"):
        require_fits("serving", serving, 1, nodes, what="replica(s)")
    monkeypatch.setenv("PREFECT_ML_CHECK_RESOURCES", "false")
    # Outside a run the warning goes to Prefect's "prefect.prefect_ml" logger, which does not
    # propagate to the root logger caplog listens on, so listen on that logger itself. Asking
    # for it first sets Prefect's logging up, which empties its child loggers' handlers: run
    # alone, the handler added before that was dropped when the warning was logged.
    logger = run_logger()
    assert isinstance(logger, logging.Logger)
    logger.addHandler(caplog.handler)
    try:
        fits = require_fits("serving", serving, 1, nodes, what="replica(s)")
    finally:
        logger.removeHandler(caplog.handler)
    assert fits == 0
    assert "serving.replica_accelerator_type: 1 replica(s)" in caplog.text
    assert "not enforced" in caplog.text


# Ray's view of a cluster with two GPU types: each GPU node carries "accelerator_type:<T>".
MIXED_GPU_NODES = [
    {"CPU": 8.0, "GPU": 2.0, "accelerator_type:H100": 1.0},
    {"CPU": 8.0, "GPU": 2.0, "accelerator_type:T4": 1.0},
    {"CPU": 4.0},
]


def test_a_gpu_group_that_could_span_gpu_types_is_refused_unless_pinned_or_allowed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    group = TrainingParams(use_gpu=True)
    with pytest.raises(ConfigurationError) as caught:
        require_one_gpu_type("training", group, 4, MIXED_GPU_NODES, what="worker(s)", allowed=False)
    assert caught.value.field == "training.accelerator_type"
    assert "different GPU types (H100, T4)" in str(caught.value)
    assert "--accelerator-type" in str(caught.value) and "--allow-mixed-gpu-types" in str(
        caught.value
    )
    # Pinned to one type, one worker, CPU workers, or one GPU type in the cluster: nothing mixes.
    for training, count, nodes in [
        (TrainingParams(use_gpu=True, accelerator_type="H100"), 4, MIXED_GPU_NODES),
        (group, 1, MIXED_GPU_NODES),
        (TrainingParams(), 4, MIXED_GPU_NODES),
        (group, 4, MIXED_GPU_NODES[:1] + MIXED_GPU_NODES[2:]),
    ]:
        require_one_gpu_type("training", training, count, nodes, what="worker(s)", allowed=False)
    logger = logging.getLogger("prefect_ml.tasks.placement")
    logger.addHandler(caplog.handler)
    try:
        require_one_gpu_type("training", group, 4, MIXED_GPU_NODES, what="worker(s)", allowed=True)
    finally:
        logger.removeHandler(caplog.handler)
    assert "slowest GPU" in caplog.text and "allowed: --allow-mixed-gpu-types" in caplog.text


def test_allowing_mixed_gpu_types_resumes_the_same_run() -> None:
    pinned = TrainModelParams(training={"use_gpu": True})
    mixed = TrainModelParams(training={"use_gpu": True, "allow_mixed_gpu_types": True})
    assert mixed.run_key("fingerprint") == pinned.run_key("fingerprint")
