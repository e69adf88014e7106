"""Which accelerator this process can train on, the collective backend that matches it, and memory.

CUDA and ROCm builds of torch share the ``torch.cuda`` API (a ROCm GPU is a ``cuda`` device and
torch's ``"nccl"`` backend is RCCL there), so both pick NCCL; MPS and CPU pick gloo. torch is
imported inside the functions so that importing this module stays cheap for the CLI.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

DeviceKind = Literal["cuda", "rocm", "mps", "cpu"]

_CLEAR_REFS = "/proc/self/clear_refs"
_PROC_STATUS = "/proc/self/status"
# A driver query that hangs (a wedged GPU) must not hang the doctor with it.
_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class DeviceRuntime:
    """What torch, the driver and the hardware of this process agree (or disagree) on."""

    kind: DeviceKind
    devices: list[str]
    torch_version: str
    runtime_version: str
    driver_version: str
    nccl_version: str
    backend: Literal["nccl", "gloo"]
    warnings: list[str] = field(default_factory=list)


def _run(command: list[str]) -> str | None:
    """The stdout of a driver tool, or None when it is not installed or fails."""
    if shutil.which(command[0]) is None:
        return None
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _nvidia_driver() -> tuple[str, int, str]:
    """(driver version, GPUs the driver lists, highest CUDA version the driver supports)."""
    listed = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    if listed is None:
        return "", 0, ""
    versions = [line.strip() for line in listed.splitlines() if line.strip()]
    header = _run(["nvidia-smi"]) or ""
    supported = re.search(r"CUDA Version:\s*([\d.]+)", header)
    return (versions[0] if versions else ""), len(versions), supported.group(1) if supported else ""


def _rocm_driver() -> str:
    shown = _run(["rocm-smi", "--showdriverversion"])
    if shown is None:
        return ""
    version = re.search(r"[Dd]river version:\s*(\S+)", shown)
    return version.group(1) if version else ""


def _nccl_version() -> str:
    import torch
    import torch.distributed

    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        return ""
    try:
        version = torch.cuda.nccl.version()
    except (RuntimeError, AttributeError):  # a build that links no NCCL library
        return ""
    return ".".join(str(part) for part in version)


def _cpu_description() -> str:
    import torch

    return (
        f"{platform.machine() or 'unknown'} CPU ({os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads)"
    )


def mismatch_warnings(
    *,
    torch_version: str,
    built_cuda: str | None,
    built_hip: str | None,
    cuda_usable: bool,
    driver: str,
    nvidia_gpus: int,
    driver_cuda: str,
) -> list[str]:
    """Why torch does not train on the GPU this machine has, each with what to do.

    Args are what torch (``torch.version.cuda``/``hip``, ``torch.cuda.is_available()``) and
    nvidia-smi (driver version, GPUs listed, "CUDA Version" of its header) report; kept apart
    from their probing so every combination can be checked without that hardware.
    """
    warnings: list[str] = []
    if nvidia_gpus and built_cuda is None and built_hip is None:
        warnings.append(
            f"nvidia-smi lists {nvidia_gpus} GPU(s) but torch {torch_version} is a CPU-only "
            "build: install a CUDA build of torch (https://pytorch.org/get-started/locally/) "
            "to train on them"
        )
    if built_cuda is not None and not cuda_usable:
        if nvidia_gpus:
            cause = f"the driver ({driver}) lists {nvidia_gpus} GPU(s): a driver/runtime problem"
        else:
            cause = "no NVIDIA driver answers (nvidia-smi is missing or lists no GPU)"
        warnings.append(
            f"torch {torch_version} is built for CUDA {built_cuda} but cannot use a GPU; {cause}. "
            "Training runs on CPU: check the NVIDIA driver is installed and loaded, "
            "CUDA_VISIBLE_DEVICES, and that the driver supports this CUDA version"
        )
    if built_hip is not None and not cuda_usable:
        warnings.append(
            f"torch {torch_version} is built for ROCm {built_hip} but cannot use a GPU: check the "
            "amdgpu driver is loaded, HIP_VISIBLE_DEVICES, and that this user may open /dev/kfd"
        )
    if built_cuda and driver_cuda and _version_tuple(driver_cuda) < _version_tuple(built_cuda):
        warnings.append(
            f"the NVIDIA driver {driver} supports CUDA up to {driver_cuda} but torch "
            f"{torch_version} is built for CUDA {built_cuda}: upgrade the driver or install a "
            f"torch built for CUDA {driver_cuda} or older"
        )
    return warnings


def detect_runtime() -> DeviceRuntime:
    """Detect the accelerator, the versions of every layer and their mismatches, for the doctor."""
    import torch

    cuda_usable = torch.cuda.is_available()
    driver, nvidia_gpus, driver_cuda = _nvidia_driver()
    if torch.version.hip is not None:
        driver = _rocm_driver() or driver
    kind: DeviceKind
    if cuda_usable:
        kind = "rocm" if torch.version.hip is not None else "cuda"
        devices = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            devices.append(f"{props.name} ({props.total_memory / 2**30:.1f} GiB)")
    elif torch.backends.mps.is_available():
        kind, devices = "mps", [f"Apple GPU via MPS ({platform.machine()})"]
    else:
        kind, devices = "cpu", [_cpu_description()]
    nccl = _nccl_version() if cuda_usable else ""
    return DeviceRuntime(
        kind=kind,
        devices=devices,
        torch_version=torch.__version__,
        runtime_version=torch.version.cuda or torch.version.hip or "",
        driver_version=driver,
        nccl_version=nccl,
        backend="nccl" if nccl else "gloo",
        warnings=mismatch_warnings(
            torch_version=torch.__version__,
            built_cuda=torch.version.cuda,
            built_hip=torch.version.hip,
            cuda_usable=cuda_usable,
            driver=driver,
            nvidia_gpus=nvidia_gpus,
            driver_cuda=driver_cuda,
        ),
    )


def collective_backend(use_gpu: bool) -> str:
    """The torch.distributed backend for this process: NCCL (RCCL on ROCm) on GPUs, else gloo.

    A GPU request on a machine without one gets gloo here; refusing that request is the resource
    check's job, not this function's.
    """
    import torch
    import torch.distributed

    if use_gpu and torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return "nccl"
    return "gloo"


def training_device(use_gpu: bool, local_rank: int = 0) -> torch.device:
    """The device a training worker puts its model on: its own GPU, MPS, or the CPU."""
    import torch

    if use_gpu and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    if use_gpu and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def seed_rngs(seed: int, device: torch.device) -> None:
    """Seed the CPU's random generator and ``device``'s: ``torch.manual_seed`` for the device
    a worker trains on. ``torch.manual_seed`` also queues a seed for each accelerator kind not
    initialised in this process (CUDA, XPU, MPS on a CPU worker), capturing a Python stack
    trace for each: 76-263 us a call measured, more in a Ray worker's deep stack, and a
    training worker seeds every epoch."""
    import torch

    torch.default_generator.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed_all(seed)
    elif device.type == "mps":
        torch.mps.manual_seed(seed)


def _can_reset_rss() -> bool:
    return os.access(_CLEAR_REFS, os.W_OK)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (one per epoch) on ``device``; MPS has none to reset."""
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif device.type == "cpu":
        # "5" resets only the peak RSS (VmHWM), not page state (Linux >= 4.0, see proc(5)).
        try:
            with open(_CLEAR_REFS, "w") as clear_refs:
                clear_refs.write("5")
        except OSError:
            pass  # not Linux, or /proc read-only: peak_memory_bytes reports the lifetime peak


def _peak_rss_bytes() -> int:
    try:
        with open(_PROC_STATUS) as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is kilobytes on Linux but bytes on macOS.
    return peak if sys.platform == "darwin" else peak * 1024


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory on ``device`` since the last :func:`reset_peak_memory`, in bytes.

    CUDA/ROCm: the most tensor memory allocated. CPU: the process's peak RSS (its lifetime peak
    where the reset is impossible). MPS keeps no peak: this is the driver's memory right now.
    """
    import torch

    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    if device.type == "mps":
        return int(torch.mps.driver_allocated_memory())
    return _peak_rss_bytes()


def peak_memory_kind(device: torch.device) -> str:
    """What :func:`peak_memory_bytes` measured on ``device``, in words for an MLflow tag."""
    if device.type == "cuda":
        return "max CUDA memory allocated"
    if device.type == "mps":
        return "MPS driver memory"
    return "peak process RSS" if _can_reset_rss() else "peak process RSS since process start"


def describe_devices(runtime: DeviceRuntime) -> str:
    """Two lines for humans: the devices, then every layer's version and the backend."""
    versions = [f"torch {runtime.torch_version}"]
    if runtime.runtime_version:
        # ROCm wheels carry it in their local version ("2.5.1+rocm6.2") even where no GPU is seen.
        rocm = runtime.kind == "rocm" or "rocm" in runtime.torch_version
        label = "ROCm" if rocm else "CUDA"
        versions.append(f"{label} runtime {runtime.runtime_version}")
    else:
        versions.append("CPU-only build" if runtime.kind == "cpu" else "no CUDA/ROCm runtime")
    if runtime.driver_version:
        versions.append(f"driver {runtime.driver_version}")
    if runtime.nccl_version:
        versions.append(f"{'RCCL' if runtime.kind == 'rocm' else 'NCCL'} {runtime.nccl_version}")
    return (
        f"{runtime.kind}: {', '.join(runtime.devices)}\n"
        f"{', '.join(versions)}; collective backend {runtime.backend}"
    )
