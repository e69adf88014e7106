"""A loaded model's forward pass for serving: on the replica's GPU when it reserved one.

Only torch and numpy: the serving replica (Ray Serve) wraps it, and the GPU check runs it on
machines that have nothing else. The device is a pure function of what the replica reserved
and what torch sees, so the choice is tested without a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

InferencePrecision = Literal["fp32", "bf16", "fp16"]
_AUTOCAST_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def serving_device(reserved_gpus: float, cuda_available: bool) -> torch.device:
    """The device a replica computes on: its GPU when it reserved one (Ray makes the reserved GPU
    the process's ``cuda:0``), else the CPU.

    A replica that reserved a GPU on a machine where torch sees none is refused: serving would
    silently run on the CPU while holding the GPU.
    """
    import torch

    if reserved_gpus <= 0:
        return torch.device("cpu")
    if not cuda_available:
        raise ConfigurationError(
            "serving.replica_gpus",
            f"the replica reserved {reserved_gpus:g} GPU but torch {torch.__version__} sees no "
            "CUDA device here (a CPU-only torch build, or a driver problem: run "
            "`prefect-ml doctor` on that node); install a CUDA build of torch or set "
            "--replica-gpus 0",
        )
    return torch.device("cuda", 0)


@dataclass(frozen=True)
class DeviceDescription:
    """What ``/metadata`` says about where a replica computes."""

    type: str
    name: str
    precision: str


class Predictor:
    """A model in eval mode on its device; turns a float32 matrix into class probabilities
    (classification) or predicted values (regression)."""

    def __init__(
        self,
        model: Any,
        sample_shape: list[int],
        device: torch.device,
        precision: InferencePrecision = "fp32",
        task: str = "classification",
        input_dtype: str = "float32",
    ) -> None:
        self.sample_shape, self.device, self.precision = sample_shape, device, precision
        self.task, self.input_dtype = task, input_dtype  # what the model's first op takes
        self.model = model.to(device)

    def outputs(self, matrix: np.ndarray) -> np.ndarray:
        """What the task answers for each row: class probabilities, or ``(rows, 1)`` values."""
        if self.task == "classification":
            return self.probabilities(matrix)
        return self._forward(matrix).float().cpu().numpy().reshape(len(matrix), -1)

    def _autocast(self) -> Any:
        import torch

        dtype = _AUTOCAST_DTYPES.get(self.precision)
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, dtype))

    def probabilities(self, matrix: np.ndarray) -> np.ndarray:
        """Softmax of the model's logits for each row of ``matrix``, as float32 on the host."""
        import torch

        return torch.softmax(self._forward(matrix).float(), dim=1).cpu().numpy()

    def _forward(self, matrix: np.ndarray) -> torch.Tensor:
        import torch

        samples = torch.from_numpy(matrix).reshape(-1, *self.sample_shape)
        samples = samples.to(self.device, getattr(torch, self.input_dtype), non_blocking=True)
        with torch.inference_mode(), self._autocast():
            return self.model(samples)  # type: ignore[no-any-return]

    def describe(self) -> DeviceDescription:
        import torch

        if self.device.type == "cuda":
            name = torch.cuda.get_device_name(self.device)
        else:
            name = "CPU"
        return DeviceDescription(type=str(self.device), name=name, precision=self.precision)
