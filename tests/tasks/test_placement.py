"""The flow-start placement check on the real local Ray (2 CPUs, no GPU)."""

from __future__ import annotations

import logging

import pytest

from integrations.errors import ConfigurationError
from integrations.resources import ResourceRequest
from integrations.settings import PrefectMLSettings
from tasks.params import REPLICA_FIELDS, CampaignParams, PipelineParams, TrainModelParams
from tasks.placement import check_placement, require_fits


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
    request = ResourceRequest(cpus=1, gpus=1, accelerator_type="H100")
    with pytest.raises(ConfigurationError, match="PREFECT_ML_CHECK_RESOURCES=false"):
        require_fits(request, 1, nodes, what="replica(s)", fields=REPLICA_FIELDS)
    monkeypatch.setenv("PREFECT_ML_CHECK_RESOURCES", "false")
    # Prefect's logging setup replaces the root handlers, so listen on the module's logger.
    logger = logging.getLogger("tasks.placement")
    logger.addHandler(caplog.handler)
    try:
        fits = require_fits(request, 1, nodes, what="replica(s)", fields=REPLICA_FIELDS)
    finally:
        logger.removeHandler(caplog.handler)
    assert fits == 0
    assert "serving.replica_accelerator_type: 1 replica(s)" in caplog.text
    assert "not enforced" in caplog.text
