"""Every field of the model, training and serving sections walks from its CLI flag and the
flow's parameters, through the tasks (and a campaign's trials), to the object a Ray Train
worker or a Serve replica receives (through the pickling Ray does), and arrives with its value:
a field added to a section, dropped on the way or copied by hand into a second schema fails
here. The fields that set what Ray reserves (training workers, campaign trials, serving
replicas) walk on to what Ray places each copy with."""

from __future__ import annotations

import json
from typing import Any

import click
import cloudpickle
import optuna
import pytest

from prefect_ml.flows.cli import Parameters, app, parse_parameters
from prefect_ml.integrations import training
from prefect_ml.integrations.config import ModelParams, SweepParams, TrainingParams
from prefect_ml.integrations.config.loop import TrainLoop
from prefect_ml.integrations.config.resources import GB, Reserve, reserving_fields
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.campaign.identity import CampaignIdentity
from prefect_ml.tasks.campaign.run import TrialPlanner
from prefect_ml.tasks.data import PreparedData, params_on_data
from prefect_ml.tasks.params import (
    CampaignParams,
    ServeModelParams,
    ServingParams,
    TrainingSections,
    TrainModelParams,
    params_from_options,
    section_options,
)
from prefect_ml.tasks.training import train_loop

MODEL = {
    "model": "tests.fixtures.user_code:linear_model",
    "hidden": 16,
    "depth": 3,
    "channels": 8,
    "dropout": 0.25,
    "model_options": {"bias": False},
}
TRAINING = {
    "epochs": 3,
    "batch_size": 16,
    "lr": 0.01,
    "optimizer": "sgd",
    "weight_decay": 0.01,
    "scheduler": "none",
    "seed": 7,
    "max_failures": 1,
    "use_gpu": True,
    "cpus_per_worker": 2.0,
    "accelerator_type": "H100",
    "allow_mixed_gpu_types": True,
    "memory_per_worker_gb": 2.5,
    "worker_resources": {"fast_disk": 1.0},
    "precision": "bf16",
    "gradient_checkpointing": True,
    "checkpoint_layout": "sharded",
    "checkpoint_every_steps": 5,
    "checkpoint_every_seconds": 30.0,
    "checkpoint_budget": 0.1,
    "collective_timeout_s": 60,
    "elastic_resize_s": 30.0,
    "keep_checkpoints": 2,
    "best_checkpoint_metric": "val_accuracy",
    "best_checkpoint_mode": "max",
    "early_stopping_patience": 2,
    "early_stopping_min_delta": 0.01,
    "early_stopping_metric": "val_accuracy",
    "early_stopping_mode": "max",
    "force": True,
}
# Two meshes: a tensor-parallel size and a pipeline's cannot both be set in one run.
MESHES = [
    {"strategy": "tp", "workers": 4, "tensor_parallel_size": 2},
    {
        "strategy": "pp",
        "workers": 4,
        "pipeline_parallel_size": 2,
        "pipeline_microbatches": 2,
        "pipeline_schedule": "gpipe",
    },
]


def _argv(values: dict[str, Any]) -> list[str]:
    """The command line that sets ``values``, as a user types it."""
    argv: list[str] = []
    for name, value in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):  # a list of names: comma-separated
            argv += [flag, ",".join(value)]
        else:
            argv += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return argv


def _from_the_command_line(
    values: dict[str, Any], command: str = "train", model: type[Parameters] = TrainModelParams
) -> Parameters:
    """The flow parameters ``prefect-ml <command>`` builds from the flags setting ``values``."""
    with app.commands[command].make_context(command, _argv(values)) as context:
        assert isinstance(context, click.Context)
        return parse_parameters(model, context.params)


def _prepared() -> PreparedData:
    return PreparedData(
        fingerprint="f" * 20,
        splits_url="file:///splits",
        sample_shape=[6],
        num_classes=3,
        class_names=["a", "b", "c"],
        rows={"train": 200, "val": 50, "test": 50},
        target_mean=0.5,
        target_std=2.0,
        layout="parquet",
    )


def _on_a_worker(loop: TrainLoop) -> TrainLoop:
    """What ``train_loop_per_worker`` receives: TorchTrainer's train_loop_config, pickled."""
    config = cloudpickle.loads(cloudpickle.dumps(training.loop_config(loop)))
    received = config["loop"]
    assert isinstance(received, TrainLoop)
    return received


def _assert_arrives(received: TrainLoop, values: dict[str, Any]) -> None:
    for name, value in values.items():
        section = received.model if name in ModelParams.model_fields else received.training
        arrived = getattr(section, name)
        expected = tuple(value) if isinstance(arrived, tuple) else value
        assert arrived == expected, f"{name}: sent {value!r}, the worker got {arrived!r}"


@pytest.mark.parametrize("mesh", MESHES, ids=[mesh["strategy"] for mesh in MESHES])
def test_every_model_and_training_field_reaches_the_training_worker_with_its_value(
    mesh: dict[str, Any],
) -> None:
    values = {**MODEL, **TRAINING, **mesh}
    params = _from_the_command_line(values)
    # The UI form and the API post the same parameters as JSON; Prefect validates them.
    assert TrainModelParams.model_validate(json.loads(params.model_dump_json())) == params
    data = _prepared()
    # The flow hands the train task its sections; a user's flow may give keyword options.
    given = params_on_data(TrainingSections, data, params, {}, step="train", experiment="e")
    options = section_options(params.model, params.training)
    built = params_on_data(TrainingSections, data, None, options, step="train", experiment="e")
    assert built.model == given.model and built.training == given.training
    loop = train_loop(given, data, checkpoint_url="file:///c")
    received = _on_a_worker(loop)
    _assert_arrives(received, values)
    assert received.model == params.model and received.training == params.training
    assert received.data.model_dump() == data.model_dump(include=set(received.data.model_fields))
    # What Ray Train places each worker with (the train task hands fit the section's resources).
    scaling = training.scaling_config(received, 4, given.training.resources())
    per_worker = {"CPU": 2.0, "GPU": 1.0, "memory": 2.5 * GB, "fast_disk": 1.0}
    assert scaling.resources_per_worker == per_worker
    assert (scaling.use_gpu, scaling.accelerator_type) == (True, "H100")


def test_a_campaign_trial_receives_the_same_sections_with_its_tuned_values(
    home: PrefectMLSettings,
) -> None:
    """A trial's worker gets the campaign's model and training sections with the trial's
    values put in, and trains every epoch (the campaign's pruner stops trials, not early
    stopping)."""
    values = {**MODEL, **TRAINING, **MESHES[0]}
    fixed = _from_the_command_line(values)
    params = CampaignParams.model_validate(
        {
            "model": fixed.model.model_dump(),
            "training": fixed.training.model_dump(),
            "sweep": {"search_space": {"lr": {"type": "float", "low": 0.001, "high": 0.1}}},
        }
    )
    identity = CampaignIdentity(name="c", key="c@0", checkpoint_root="file:///campaign")
    planner = TrialPlanner.of(params, _prepared(), identity, home)
    loop = planner.trial_loop({"lr": 0.05}, "file:///campaign/trial-00003", 3)
    received = _on_a_worker(loop)
    _assert_arrives(received, {**values, "lr": 0.05, "early_stopping_patience": None})


TRIAL_RESOURCES = {
    "trial_workers": 2,
    "trial_cpus": 2.0,
    "trial_gpus": 0.5,
    "trial_accelerator_type": "A10G",
    "trial_memory_gb": 1.5,
    "trial_resources": {"fast_disk": 1.0},
}


def test_every_trial_resource_field_reaches_what_ray_places_a_trial_with(
    home: PrefectMLSettings,
) -> None:
    """From ``prefect-ml sweep``'s flags to the spec a trial actor receives (pickled by Ray):
    with one worker the pool places each trial's actor with the request, with several each of
    the trial's Ray Train workers holds it."""
    params = _from_the_command_line(TRIAL_RESOURCES, "sweep", CampaignParams)
    assert CampaignParams.model_validate(json.loads(params.model_dump_json())) == params
    identity = CampaignIdentity(name="c", key="c@0", checkpoint_root="file:///campaign")
    planner = TrialPlanner.of(params, _prepared(), identity, home)
    spec, _ = planner(optuna.create_study().ask())
    received = cloudpickle.loads(cloudpickle.dumps(spec))
    assert received.workers == 2
    assert received.request.actor_options() == {
        "num_cpus": 2.0,
        "num_gpus": 0.5,
        "memory": int(1.5 * GB),
        "accelerator_type": "A10G",
        "resources": {"fast_disk": 1.0},
    }
    scaling = training.scaling_config(received.loop, received.workers, received.request)
    per_worker = {"CPU": 2.0, "GPU": 0.5, "memory": 1.5 * GB, "fast_disk": 1.0}
    assert (scaling.resources_per_worker, scaling.accelerator_type) == (per_worker, "A10G")


def test_the_walks_cover_every_field_of_the_model_and_training_sections() -> None:
    """A new field must join the walk above with a value other than its default."""
    covered = set(MODEL) | set(TRAINING) | {name for mesh in MESHES for name in mesh}
    assert covered == set(ModelParams.model_fields) | set(TrainingParams.model_fields)
    defaults = {**ModelParams().model_dump(), **TrainingParams().model_dump()}
    for mesh in MESHES:
        for name, value in {**MODEL, **TRAINING, **mesh}.items():
            assert value != defaults[name], f"{name} is walked with its default"


SERVING = {
    "host": "10.0.0.5",
    "port": 8123,
    "app_name": "walked",
    "route_prefix": "/walk",
    "batching": False,
    "max_batch_size": 16,
    "batch_wait_timeout_s": 0.01,
    "batch_inline_below_s": 0.005,
    "min_replicas": 2,
    "max_replicas": 3,
    "target_ongoing_requests": 4.0,
    "max_ongoing_requests": 32,
    "max_queued_requests": 100,
    "retry_after_s": 2.0,
    "access_log": False,
    "request_timeout_s": 10.0,
    "deploy_timeout_s": 60.0,
    "replica_cpus": 2.0,
    "replica_gpus": 0.5,
    "replica_accelerator_type": "A10G",
    "inference_precision": "bf16",
    "replica_memory_gb": 1.5,
    "replica_resources": {"fast_disk": 1.0},
    "max_rows": 100,
    "max_body_bytes": 2048,
    "max_models_per_replica": 1,
    "other_models": ["walked-other", "another"],
    "smoke_test": False,
    "canary_share": 0.1,
    "canary_window_s": 60.0,
    "canary_min_requests": 5,
    "canary_max_error_increase": 0.05,
    "canary_max_latency_ratio": 2.0,
    "canary_max_metric_drop": 0.05,
}


def test_every_serving_field_reaches_the_serve_replica_with_its_value() -> None:
    """From ``prefect-ml serve``'s flags to what each replica's constructor parses (Serve
    pickles its arguments), and to the deployment's options."""
    from prefect_ml.integrations import serving
    from prefect_ml.integrations.serving import ServedModel
    from prefect_ml.tasks.serve import replica_options

    assert set(SERVING) == set(ServingParams.model_fields)
    defaults = ServingParams().model_dump()
    assert not [name for name, value in SERVING.items() if value == defaults[name]]
    flags = {"model_name": "walked", **SERVING}
    params = _from_the_command_line(flags, "serve", ServeModelParams)
    assert ServeModelParams.model_validate(json.loads(params.model_dump_json())) == params
    given = params_from_options(
        ServeModelParams, {}, step="serve", model_name="walked", serving=params.serving
    )
    options = replica_options(given.serving, token="secret")
    served = ServedModel(name="walked", version="1", run_id="r", tracking_uri="", sample_shape=[4])
    arguments = cloudpickle.loads(cloudpickle.dumps(serving.replica_arguments(served, options)))
    received = serving.ReplicaOptions.model_validate(arguments[1])  # as ModelServer does
    for name, value in SERVING.items():
        assert getattr(received.serving, name) == value, name
    assert received.token_sha256 == serving.token_digest("secret")
    deployment = serving.deployment_options(received.serving, allow_surge=True)
    assert deployment["autoscaling_config"]["max_replicas"] == 3
    assert deployment["max_queued_requests"] == 100
    assert deployment["ray_actor_options"] == {
        "num_cpus": 2.0,
        "num_gpus": 0.5,
        "memory": int(1.5 * GB),
        "accelerator_type": "A10G",
        "resources": {"fast_disk": 1.0},
    }


def test_the_walks_cover_every_field_that_sets_what_ray_reserves() -> None:
    """Each of the three sections sets every part of a request with one marked field, and the
    walks above carry each of those fields with a value other than its default."""
    walked = {
        TrainingParams: {**TRAINING, **MESHES[0]},
        SweepParams: TRIAL_RESOURCES,
        ServingParams: SERVING,
    }
    for section, values in walked.items():
        marked = reserving_fields(section)
        assert set(marked) == set(Reserve), f"{section.__name__} leaves parts unset"
        defaults = section().model_dump()
        for name in marked.values():
            assert name in values and values[name] != defaults[name], f"{name} is not walked"


PREDICT = {
    "model_name": "walked",
    "alias": "staging",
    "model_version": "3",
    "url": "file:///rows/",
    "output": "file:///scores/",
    "force": True,
    "batch_size": 512,
    "concurrency": 3,
    "cpus_per_actor": 2.0,
    "use_gpu": True,
    "inference_precision": "bf16",
}


def test_every_predict_field_reaches_the_scoring_task_and_the_actors_with_its_value() -> None:
    """From ``prefect-ml predict``'s flags to the section the scoring step reads, and to each
    scoring actor's constructor arguments (Ray Data pickles them)."""
    from prefect_ml.integrations import serving
    from prefect_ml.integrations.serving import ServedModel
    from prefect_ml.tasks.params import PredictParams

    assert set(PREDICT) == set(PredictParams.model_fields)
    defaults = PredictParams().model_dump()
    assert not [name for name, value in PREDICT.items() if value == defaults[name]]
    params = _from_the_command_line(PREDICT, "predict", PredictParams)
    assert PredictParams.model_validate(json.loads(params.model_dump_json())) == params
    for name, value in PREDICT.items():
        assert getattr(params, name) == value, name
    served = ServedModel(name="walked", version="3", run_id="r", tracking_uri="", sample_shape=[4])
    columns = serving.ScoringColumns(features=["a", "b", "c", "d"], passthrough=[])
    arguments = serving.scorer_arguments(served, columns, params)
    received = cloudpickle.loads(cloudpickle.dumps(arguments))
    assert (received["gpus"], received["precision"], received["threads"]) == (1.0, "bf16", 2)


def test_a_task_takes_its_sections_or_keyword_options_not_both() -> None:
    import prefect_ml
    from prefect_ml import ConfigurationError

    with pytest.raises(ConfigurationError, match="train\\(\\) takes its sections or keyword"):
        prefect_ml.train.fn(_prepared(), TrainModelParams(), epochs=3)
    with pytest.raises(ConfigurationError, match="serve\\(\\) takes its sections"):
        prefect_ml.serve.fn("m", serving=ServingParams(), port=8001)
