"""``prefect-ml train --strategy tp`` and ``--strategy pp`` on 2 Ray Train CPU workers: each
trains the built-in MLP, logs per-rank memory and step time with its communication, and
registers a model that evaluates well."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from prefect_ml.flows.cli import app
from prefect_ml.integrations import tracking
from prefect_ml.integrations.settings import PrefectMLSettings


@pytest.mark.usefixtures("ray_cluster")
def test_tensor_and_pipeline_parallel_train_and_register_the_builtin_mlp(
    home: PrefectMLSettings,
) -> None:
    client = tracking.client_for(home.resolved_tracking_uri)
    measured = {"tp": "collectives_per_step", "pp": "p2p_bytes_per_step"}
    for strategy, communication in measured.items():  # the second reuses the prepared data
        name = f"digits-{strategy}"
        command = ["train", "--strategy", strategy, "--workers", "2", "--epochs", "2"]
        result = CliRunner().invoke(app, [*command, "--model-name", name])
        assert result.exit_code == 0, result.output

        (version,) = client.search_model_versions(f"name='{name}'")
        run = client.get_run(version.run_id)
        assert run.data.params["training.strategy"] == strategy
        metrics = run.data.metrics
        assert metrics[communication] > 0
        assert {"peak_memory_mib_rank0", "peak_memory_mib_rank1", "step_seconds_rank1"} <= set(
            metrics
        )
        assert metrics["val_accuracy"] > 0.8, "2 epochs of digits train a usable MLP"
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [1, 2]
