"""Collectives on the device their process group serves, checked on CPU.

NCCL reduces CUDA tensors only. A gloo group registered for CUDA alone (``"cuda:gloo"``) refuses
CPU tensors with NCCL's very error, so the GPU bug of issue 16 (a CPU tensor in an NCCL
all-reduce at the end of the first epoch) is reproduced here without a GPU.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from prefect_ml.integrations import training
from prefect_ml.integrations.errors import ConfigurationError
from tests.helpers import blob_trainer, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("flows", "tasks", "integrations")
COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
}


@contextmanager
def process_group(backend: str) -> Iterator[None]:
    """A one-worker process group in this process, destroyed afterwards."""
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("config", "served"),
    [
        ("cuda:nccl", {"cuda"}),
        ("nccl", {"cuda"}),
        ("cpu:gloo,cuda:gloo", {"cpu", "cuda"}),
        ("cuda:gloo", {"cuda"}),
        ("cpu:gloo,cuda:nccl", {"cpu", "cuda"}),
    ],
)
def test_served_device_types_read_torchs_backend_configuration(
    config: str, served: set[str]
) -> None:
    assert training.served_device_types(config) == served


def test_a_cpu_worker_in_a_group_that_reduces_only_cuda_tensors_is_refused_before_training(
    tmp_path: Path,
) -> None:
    """The NCCL situation on CPU: the old trainer started, trained an epoch, then crashed in its
    metrics all-reduce with "No backend type associated with device type cpu"."""
    with process_group("cuda:gloo"):
        with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.ones(1))  # the group really refuses CPU tensors
        with pytest.raises(ConfigurationError, match="training.use_gpu.*reduces only \\['cuda'\\]"):
            blob_trainer(tmp_path.as_uri(), model="mlp", model_options={"hidden": 8})
    assert not list(tmp_path.iterdir())  # nothing trained, nothing written


def test_a_trainer_in_a_cpu_group_reduces_its_metrics_there(tmp_path: Path) -> None:
    with process_group("gloo"):
        trainer = blob_trainer(tmp_path.as_uri(), model="mlp", model_options={"hidden": 8})
        metrics = trainer.train_epoch(1)
    assert metrics["workers"] == 1 and metrics["train_loss"] > 0


def _reduce_worker(rank: int, world_size: int, port: int, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    cpu = torch.device("cpu")
    summed = training.all_reduce([torch.tensor(rank + 1.0), 10.0], cpu)
    maxed = training.all_reduce([rank], cpu, op="max")
    anyone = training.any_worker(rank == 1, cpu)
    if rank == 0:
        Path(out).write_text(json.dumps({"sum": summed, "max": maxed, "any": anyone}))
    dist.destroy_process_group()


def test_all_reduce_sums_tensors_and_numbers_and_every_worker_agrees_on_a_flag(
    tmp_path: Path,
) -> None:
    out = tmp_path / "reduced.json"
    mp.start_processes(
        _reduce_worker, args=(2, free_port(), str(out)), nprocs=2, start_method="spawn"
    )
    assert json.loads(out.read_text()) == {"sum": [3.0, 20.0], "max": [1.0], "any": True}


def test_outside_a_process_group_the_answer_is_this_workers() -> None:
    cpu = torch.device("cpu")
    assert training.all_reduce([torch.tensor(2.5), 4], cpu) == [2.5, 4.0]
    assert training.any_worker(False, cpu) is False


# Receivers whose calls of these names are not torch.distributed's: our module, and asyncio's
# gather (the storage module reads a checkpoint's objects concurrently with it).
NOT_TORCH_DISTRIBUTED = {"_collectives", "training", "asyncio"}


def test_no_collective_is_called_outside_the_collectives_module() -> None:
    """Every collective goes through ``integrations/training/_collectives.py``, which builds its
    tensor on the worker's device: a direct ``dist.all_reduce`` elsewhere is how the NCCL bug
    came in."""
    found = []
    for package in PROJECT_PACKAGES:
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            if path == REPO_ROOT / "integrations" / "training" / "_collectives.py":
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr in COLLECTIVES
                    and not (
                        isinstance(node.func.value, ast.Name)
                        and node.func.value.id in NOT_TORCH_DISTRIBUTED
                    )
                ):
                    found.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.func.attr}")
    assert not found, found


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_gpu_trainer_under_nccl_reduces_on_the_gpu_and_resumes_from_its_checkpoint(
    tmp_path: Path,
) -> None:
    """The reproduction of issue 16: train, checkpoint and resume in a one-worker NCCL group."""
    cuda = torch.device("cuda", 0)
    torch.cuda.set_device(cuda)
    with process_group("nccl"):
        trainer = blob_trainer(tmp_path.as_uri(), model="mlp", device=cuda)
        first = trainer.train_epoch(1)
        trainer.store.save(1, trainer.snapshot(1))
        resumed = blob_trainer(tmp_path.as_uri(), model="mlp", device=cuda)
        second = resumed.train_epoch(resumed.first_epoch)
    assert resumed.first_epoch == 2 and second["train_loss"] < first["train_loss"]
    assert first["peak_memory_mib"] > 0
