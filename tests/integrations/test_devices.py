"""Device runtime detection, backend/device choice and per-epoch peak memory, on real torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prefect_ml.integrations import compute

REPO_ROOT = Path(__file__).resolve().parents[2]

MiB = 2**20
GiB = 2**30

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="asserts the CPU-only answers")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@cpu_only
def test_cpu_machine_detects_cpu_and_gloo() -> None:
    runtime = compute.detect_runtime()
    assert (runtime.kind, runtime.backend, runtime.nccl_version) == ("cpu", "gloo", "")
    assert runtime.torch_version == torch.__version__
    assert runtime.runtime_version == (torch.version.cuda or torch.version.hip or "")
    assert runtime.devices and "CPU" in runtime.devices[0]
    text = compute.describe_devices(runtime)
    assert text.startswith("cpu: ") and f"torch {torch.__version__}" in text and "gloo" in text


@cpu_only
def test_gpu_request_without_gpu_falls_back_to_gloo_and_cpu() -> None:
    assert compute.collective_backend(True) == "gloo"
    assert compute.collective_backend(False) == "gloo"
    assert compute.training_device(True, local_rank=1) == torch.device("cpu")
    assert compute.training_device(False) == torch.device("cpu")


def test_cpu_only_torch_on_a_gpu_machine_says_install_a_cuda_build() -> None:
    found = compute.mismatch_warnings(
        torch_version="2.13.0+cpu",
        built_cuda=None,
        built_hip=None,
        cuda_usable=False,
        driver="570.86",
        nvidia_gpus=2,
        driver_cuda="12.8",
    )
    assert len(found) == 1
    assert "lists 2 GPU(s)" in found[0] and "install a CUDA build of torch" in found[0]


def test_cuda_torch_that_cannot_use_the_gpu_blames_driver_or_runtime() -> None:
    found = compute.mismatch_warnings(
        torch_version="2.13.0+cu126",
        built_cuda="12.6",
        built_hip=None,
        cuda_usable=False,
        driver="570.86",
        nvidia_gpus=1,
        driver_cuda="12.8",
    )
    assert len(found) == 1
    assert "CUDA 12.6" in found[0] and "driver (570.86)" in found[0]
    assert "driver/runtime problem" in found[0]


@pytest.mark.parametrize(
    ("driver_cuda", "warned"), [("12.2", True), ("12.6", False), ("13.0", False)]
)
def test_driver_older_than_torch_runtime_is_warned(driver_cuda: str, warned: bool) -> None:
    found = compute.mismatch_warnings(
        torch_version="2.13.0+cu126",
        built_cuda="12.6",
        built_hip=None,
        cuda_usable=True,
        driver="535.1",
        nvidia_gpus=1,
        driver_cuda=driver_cuda,
    )
    assert bool(found) is warned
    if warned:
        assert f"supports CUDA up to {driver_cuda}" in found[0] and "upgrade the driver" in found[0]


def test_matching_cuda_stack_has_no_warnings() -> None:
    assert not compute.mismatch_warnings(
        torch_version="2.13.0+cu126",
        built_cuda="12.6",
        built_hip=None,
        cuda_usable=True,
        driver="570.86",
        nvidia_gpus=8,
        driver_cuda="12.8",
    )


# Runs in its own process so nothing else pytest allocates can move the process's peak RSS.
_CPU_PEAK_PROBE = """
import gc, json
import numpy as np
import torch
from prefect_ml.integrations import compute

cpu = torch.device("cpu")
compute.reset_peak_memory(cpu)
before = compute.peak_memory_bytes(cpu)
block = np.ones(200 * 2**20 // 8)  # np.ones writes every page, so all of it is resident
during = compute.peak_memory_bytes(cpu)
del block
gc.collect()
compute.reset_peak_memory(cpu)
after = compute.peak_memory_bytes(cpu)
print(json.dumps({"before": before, "during": during, "after": after,
                  "kind": compute.peak_memory_kind(cpu)}))
"""


@pytest.mark.skipif(not os.access("/proc/self/clear_refs", os.W_OK), reason="needs Linux /proc")
def test_cpu_peak_rss_tracks_an_allocation_and_resets_once_it_is_freed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CPU_PEAK_PROBE],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    peak = json.loads(done.stdout.splitlines()[-1])
    assert peak["kind"] == "peak process RSS"
    assert peak["during"] - peak["before"] >= 190 * MiB
    assert peak["after"] < peak["during"] - 150 * MiB


@pytest.mark.parametrize(
    ("device", "kind"),
    [
        ("cpu", "peak process RSS"),
        ("cuda", "max CUDA memory allocated"),
        ("mps", "MPS driver memory"),
    ],
)
def test_peak_memory_kind_names_what_was_measured(device: str, kind: str) -> None:
    assert compute.peak_memory_kind(torch.device(device)).startswith(kind)


@pytest.mark.gpu
@needs_cuda
def test_gpu_machine_detects_cuda_and_nccl() -> None:
    runtime = compute.detect_runtime()
    expected_kind = "rocm" if torch.version.hip else "cuda"
    assert (runtime.kind, runtime.backend) == (expected_kind, "nccl")
    assert len(runtime.devices) == torch.cuda.device_count()
    assert runtime.nccl_version and runtime.runtime_version
    assert runtime.torch_version == torch.__version__
    assert compute.collective_backend(True) == "nccl"
    assert compute.collective_backend(False) == "gloo"
    assert compute.training_device(True) == torch.device("cuda", 0)
    assert compute.describe_devices(runtime).startswith(f"{expected_kind}: ")


@pytest.mark.gpu
@needs_cuda
def test_cuda_peak_memory_tracks_a_1_gib_allocation() -> None:
    cuda = compute.training_device(True)
    compute.reset_peak_memory(cuda)
    before = compute.peak_memory_bytes(cuda)
    block = torch.ones(GiB, dtype=torch.uint8, device=cuda)
    assert compute.peak_memory_bytes(cuda) - before >= GiB
    del block
    compute.reset_peak_memory(cuda)
    assert compute.peak_memory_bytes(cuda) < before + GiB
    assert compute.peak_memory_kind(cuda) == "max CUDA memory allocated"


def test_a_cpu_worker_seeded_draws_what_torch_manual_seed_draws_and_queues_no_cuda_seed() -> None:
    """Every epoch a training worker seeds torch (its dropout masks and data order replay on a
    resume). On the CPU that is the default generator alone: the same draws as
    ``torch.manual_seed``, without queueing the lazy CUDA seed whose stack trace it captures
    on every call (torch.manual_seed replaces the queued one each time)."""
    torch.manual_seed(1234)
    expected = (torch.rand(5), torch.randint(0, 10, (5,)), torch.randn(3))
    torch.manual_seed(0)
    queued = torch.cuda._lazy_seed_tracker.manual_seed_all_cb
    assert queued is not None  # what torch.manual_seed queued on this CPU-only process

    compute.seed_rngs(1234, torch.device("cpu"))

    drawn = (torch.rand(5), torch.randint(0, 10, (5,)), torch.randn(3))
    for ours, theirs in zip(drawn, expected, strict=True):
        assert torch.equal(ours, theirs)
    assert torch.cuda._lazy_seed_tracker.manual_seed_all_cb is queued
