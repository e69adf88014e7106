"""The device mesh of ``--strategy tp`` and ``--strategy pp``, and how a model is split over it.

The workers form a 2-D mesh ``("dp", "tp")`` or ``("dp", "pp")``: consecutive ranks hold one
model replica (a tensor-parallel group, or one pipeline), and the replicas train data-parallel
over ``"dp"`` with FSDP2 (``fully_shard``), as TorchTitan composes them. Every rank of a replica
reads the same batches (its data-parallel coordinate picks the shard and the shuffle), so with
one replica the run sees the whole split in one process's order.

Tensor parallelism is DTensor's ``parallelize_module``. The built-in plan of an
``nn.Sequential`` pairs a ``Linear``, the elementwise layers after it and the next ``Linear``
as ``ColwiseParallel`` -> ``RowwiseParallel`` (one all-reduce per pair in forward); a ``Linear``
left unpaired (anything not elementwise follows it, or it is the last) splits its outputs and
gathers them (``ColwiseParallel(output_layouts=Replicate())``). Other layers (the CNN's
convolutions) stay replicated: their gradients agree on every rank because their inputs and
the gathered outputs do. A model defines :meth:`ModelParallelHooks.tensor_parallel_plan` to
use its own plan instead (the contract: :mod:`integrations.contracts`).

Pipeline parallelism is ``torch.distributed.pipelining``: each rank keeps the whole
``nn.Sequential`` with the layers of the other stages replaced by ``nn.Identity`` (so its state
dict holds its own layers under the full model's names, as TorchTitan keeps them), wrapped in a
``PipelineStage`` and driven by ``Schedule1F1B`` or ``ScheduleGPipe``. Stages are contiguous
and balanced by parameter count. A model defines :meth:`ModelParallelHooks.pipeline_stage` to
cut itself. Stage buffers are shaped by the first microbatch a schedule sees, so each batch
shape (the full batches, a smaller last batch, validation batches) gets its own stage and
schedule over the same layers, and a batch runs as the largest number of equal microbatches,
at most ``pipeline_microbatches``, that divides its rows (with 4, a last batch of 6 rows runs
as 3 microbatches, one of 5 rows as 1): the gradient is then exactly the batch's mean, as in
one process.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

    from prefect_ml.integrations.config import TrainingParams

SIZE_FIELDS = {"tp": "tensor_parallel_size", "pp": "pipeline_parallel_size"}
SCHEDULES = ("1f1b", "gpipe")


@dataclass(frozen=True)
class MeshLayout:
    """How ``world_size`` ranks split into data-parallel replicas of ``model_parallel`` ranks.

    ``model_parallel`` is 1 for ddp and fsdp (every rank is its own replica).
    """

    strategy: str
    data_parallel: int
    model_parallel: int

    @classmethod
    def of(cls, training: TrainingParams, world_size: int) -> MeshLayout:
        """The layout of the training section's strategy on ``world_size`` ranks; raises a
        :class:`ConfigurationError` naming the size field when it does not divide them."""
        field = SIZE_FIELDS.get(training.strategy)
        if field is None or world_size == 1:
            return cls(training.strategy, world_size, 1)
        size = getattr(training, field) or world_size
        if size < 2 or world_size % size:
            raise ConfigurationError(
                f"training.{field}",
                f"{size} must be at least 2 and divide the {world_size} workers; use a "
                f"--{field.replace('_', '-')} that divides --workers",
            )
        return cls(training.strategy, world_size // size, size)

    @property
    def dim(self) -> str:
        """The model-parallel mesh dimension's name: ``"tp"`` or ``"pp"``."""
        return self.strategy if self.strategy in SIZE_FIELDS else "mp"

    def data_rank(self, rank: int) -> int:
        """The replica ``rank`` belongs to: which shard it reads and how it shuffles."""
        return rank // self.model_parallel

    def model_rank(self, rank: int) -> int:
        """``rank``'s place in its replica: its tensor-parallel rank or its pipeline stage."""
        return rank % self.model_parallel

    def reports(self, rank: int) -> bool:
        """Whether ``rank`` adds its replica's loss, rows and validation sums to the epoch's
        metrics: one rank per replica (tp: the first of the group, which holds the replicated
        outputs as every member does; pp: the last stage, the only one with outputs)."""
        if self.model_parallel == 1:
            return True
        last = self.model_parallel - 1 if self.strategy == "pp" else 0
        return self.model_rank(rank) == last

    def build(self, device: torch.device) -> DeviceMesh:
        """The ``(dp, tp|pp)`` device mesh (a collective: every rank calls it once)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(
            device.type,
            (self.data_parallel, self.model_parallel),
            mesh_dim_names=("dp", self.dim),
        )


def check_precision(training: TrainingParams) -> None:
    """Refuse fp16 under tp and pp before any compute: its gradient scaler is per rank, and
    ranks that skip steps on their own shards' overflow diverge."""
    if training.strategy in SIZE_FIELDS and training.precision == "fp16":
        raise ConfigurationError(
            "training.precision",
            f"fp16's gradient scaler is per rank and cannot run under --strategy "
            f"{training.strategy}; use --precision bf16",
        )


def shard_over_data_parallel(model: nn.Module, dp_mesh: DeviceMesh) -> nn.Module:
    """FSDP2 over the data-parallel sub-mesh: each top-level child with parameters, then the
    root (2-D with tensor-parallel DTensor parameters, as TorchTitan does)."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        if next(child.parameters(), None) is not None:
            fully_shard(child, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


# ---------------------------------------------------------------------------- tensor parallel


def _elementwise_types() -> tuple[type, ...]:
    from torch import nn

    return (
        nn.ReLU,
        nn.GELU,
        nn.SiLU,
        nn.Tanh,
        nn.Sigmoid,
        nn.LeakyReLU,
        nn.ELU,
        nn.Mish,
        nn.Hardswish,
        nn.Softplus,
        nn.Dropout,
        nn.Identity,
    )


def sequential_plan(model: nn.Sequential, size: int) -> dict[str, ParallelStyle]:
    """The built-in tensor-parallel plan of an ``nn.Sequential`` over ``size`` ranks.

    Raises:
        ConfigurationError: no ``Linear`` to split, or a paired width ``size`` does not divide.
    """
    from torch import nn
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, ParallelStyle] = {}
    pending: tuple[str, nn.Linear] | None = None  # a Linear waiting for its row-wise partner
    for name, child in model.named_children():
        if isinstance(child, nn.Linear) and pending is not None:
            first_name, first = pending
            if first.out_features % size:
                raise ConfigurationError(
                    "model.model_options",
                    f"layer {first_name} has {first.out_features} outputs, which "
                    f"tensor_parallel_size {size} does not divide; use a width (e.g. "
                    f"--model-options hidden=...) that {size} divides, or another "
                    "--tensor-parallel-size",
                )
            plan[first_name], plan[name] = ColwiseParallel(), RowwiseParallel()
            pending = None
        elif isinstance(child, nn.Linear):
            pending = (name, child)
        elif not isinstance(child, _elementwise_types()) and pending is not None:
            plan[pending[0]] = ColwiseParallel(output_layouts=Replicate())
            pending = None
    if pending is not None:
        plan[pending[0]] = ColwiseParallel(output_layouts=Replicate())
    if not plan:
        raise ConfigurationError(
            "training.strategy",
            f"{type(model).__name__} has no nn.Linear layer for the built-in tensor-parallel "
            "plan to split; define tensor_parallel_plan(self, tp_mesh) on the model (see "
            "prefect_ml.integrations.contracts.ModelParallelHooks) or use --strategy fsdp",
        )
    return plan


def tensor_parallel_plan(model: nn.Module, tp_mesh: DeviceMesh) -> dict[str, ParallelStyle]:
    """The model's own plan (:meth:`ModelParallelHooks.tensor_parallel_plan`), else the
    built-in plan of an ``nn.Sequential``."""
    from torch import nn

    hook = getattr(model, "tensor_parallel_plan", None)
    if callable(hook):
        return hook(tp_mesh)  # type: ignore[no-any-return]
    if not isinstance(model, nn.Sequential):
        raise _not_sequential(model, "tensor_parallel_plan")
    return sequential_plan(model, tp_mesh.size())


def parallelize_tensors(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``model`` split over the mesh's ``tp`` dimension, then, with more than one replica,
    sharded by FSDP2 over ``dp``. Parameter names stay the plain model's."""
    from torch.distributed.tensor.parallel import parallelize_module

    tp_mesh = mesh["tp"]
    parallelize_module(model, tp_mesh, tensor_parallel_plan(model, tp_mesh))
    if mesh["dp"].size() > 1:
        shard_over_data_parallel(model, mesh["dp"])
    return model


# -------------------------------------------------------------------------- pipeline parallel


def balanced_stages(weights: list[int], stages: int) -> list[int]:
    """Where ``stages`` contiguous groups of layers with ``weights`` parameters start, each
    group holding at least one layer, the largest group as small as it can be."""
    count = len(weights)
    prefix = [0]
    for weight in weights:
        prefix.append(prefix[-1] + weight)
    # best[k][i]: the smallest largest group of the first i layers cut into k groups
    best = [[math.inf] * (count + 1) for _ in range(stages + 1)]
    cut = [[0] * (count + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, count + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    starts, end = [], count
    for k in range(stages, 0, -1):
        end = cut[k][end]
        starts.append(end)
    return starts[::-1]


def _parameter_layers(model: nn.Sequential, stages: int) -> list[int]:
    """The indices of the layers with parameters; at least one for each of ``stages``."""
    holders = [
        index
        for index, child in enumerate(model.children())
        if next(child.parameters(), None) is not None
    ]
    if len(holders) < stages:
        raise ConfigurationError(
            "training.pipeline_parallel_size",
            f"{type(model).__name__} has {len(holders)} layers with parameters, fewer than "
            f"the {stages} pipeline stages; lower --pipeline-parallel-size or use a deeper "
            "model (e.g. --model-options depth=...)",
        )
    return holders


def check_split(model: nn.Module, strategy: str, size: int) -> None:
    """Refuse, on the driver before any worker starts, a model that the built-in plan (tp)
    or split (pp) cannot cut over ``size`` ranks; a meta-device model is enough. A model's
    own hook is checked where it runs, on the workers."""
    from torch import nn

    hook = {"tp": "tensor_parallel_plan", "pp": "pipeline_stage"}.get(strategy)
    if hook is None or callable(getattr(model, hook, None)):
        return
    if not isinstance(model, nn.Sequential):
        raise _not_sequential(model, hook)
    if strategy == "tp":
        sequential_plan(model, size)
    else:
        _parameter_layers(model, size)


def _not_sequential(model: nn.Module, hook: str) -> ConfigurationError:
    what = "tensor-parallel plan" if hook == "tensor_parallel_plan" else "pipeline split"
    signature = "tp_mesh" if hook == "tensor_parallel_plan" else "stage, stages"
    return ConfigurationError(
        "training.strategy",
        f"{type(model).__name__} is not an nn.Sequential, which the built-in {what} needs; "
        f"define {hook}(self, {signature}) on the model (see "
        "prefect_ml.integrations.contracts.ModelParallelHooks) or use --strategy fsdp",
    )


def sequential_stage(model: nn.Sequential, stage: int, stages: int) -> nn.Sequential:
    """``model`` with every layer outside stage ``stage`` of ``stages`` replaced by
    ``nn.Identity`` (in place). A stage starts at a layer with parameters; the layers without
    (activations, dropout, flatten) ride with the layer before them."""
    from torch import nn

    names = [name for name, _ in model.named_children()]
    holders = _parameter_layers(model, stages)
    # Units: a layer with parameters and the parameter-free layers after it (the first unit
    # also takes those before it).
    unit_starts = [0, *holders[1:]]
    unit_weights = [sum(p.numel() for p in model[start].parameters()) for start in holders]
    first_units = balanced_stages(unit_weights, stages)
    begin = unit_starts[first_units[stage]]
    end = unit_starts[first_units[stage + 1]] if stage + 1 < stages else len(names)
    for index, name in enumerate(names):
        if not begin <= index < end:
            model._modules[name] = nn.Identity()
    return model


def stage_module(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """The part of ``model`` that pipeline stage ``stage`` of ``stages`` runs: the model's own
    (:meth:`ModelParallelHooks.pipeline_stage`), else the balanced cut of an ``nn.Sequential``."""
    from torch import nn

    hook = getattr(model, "pipeline_stage", None)
    if callable(hook):
        names = set(model.state_dict())
        module: nn.Module = hook(stage, stages)
        unknown = sorted(set(module.state_dict()) - names)
        if unknown:
            raise ConfigurationError(
                "model.pipeline_stage",
                f"{type(model).__name__}.pipeline_stage({stage}, {stages}) returned a module "
                f"with state-dict names the full model lacks ({unknown[:3]}); return the model "
                "itself with the other stages' layers replaced by nn.Identity",
            )
        return module
    if not isinstance(model, nn.Sequential):
        raise _not_sequential(model, "pipeline_stage")
    return sequential_stage(model, stage, stages)


def pipeline_stage_module(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """This rank's stage of ``model`` on ``device``, sharded by FSDP2 over ``dp`` when the mesh
    has more than one pipeline (``torch.distributed.pipelining`` supports FSDP and DDP stages;
    FSDP is TorchTitan's choice and the one used here)."""
    pp_mesh = mesh["pp"]
    module = stage_module(model, pp_mesh.get_local_rank(), pp_mesh.size()).to(device)
    if mesh["dp"].size() > 1:
        shard_over_data_parallel(module, mesh["dp"])
    return module


def microbatches_for(rows: int, most: int) -> int:
    """The largest number of equal microbatches, at most ``most``, that ``rows`` splits into."""
    return next(count for count in range(min(most, rows), 0, -1) if rows % count == 0)


class Pipeline:
    """One rank's pipeline stage and its schedules, one per batch shape (see the module doc).

    Every rank of a pipeline calls :meth:`train_step` and :meth:`forward` with the same
    batches; only the first stage reads the features and only the last one the targets.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        device: torch.device,
        loss: Callable[[Any, Any], torch.Tensor],
        *,
        microbatches: int,
        schedule: str,
    ) -> None:
        if schedule not in SCHEDULES:
            raise ConfigurationError(
                "training.pipeline_schedule", f"{schedule!r} is not one of {list(SCHEDULES)}"
            )
        pp_mesh = mesh["pp"]
        self.module, self.device, self.loss = module, device, loss
        self.group = pp_mesh.get_group()
        self.stage, self.stages = pp_mesh.get_local_rank(), pp_mesh.size()
        self.microbatches, self.schedule_name = microbatches, schedule
        self._schedules: dict[tuple[int, bool], Any] = {}
        self.last_microbatches = 0  # of the latest training step

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def _schedule(self, rows: int, training: bool) -> Any:
        """The stage and schedule of batches of ``rows`` rows (built on first use)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        key = (rows, training)
        if key not in self._schedules:
            stage = PipelineStage(
                self.module, self.stage, self.stages, self.device, group=self.group
            )
            kind = Schedule1F1B if training and self.schedule_name == "1f1b" else ScheduleGPipe
            self._schedules[key] = kind(
                stage,
                microbatches_for(rows, self.microbatches),
                loss_fn=self.loss if training else None,
            )
        return self._schedules[key]

    def train_step(self, features: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one batch through the pipeline (gradients accumulate in the
        stage's parameters); the batch's mean loss on the last stage, zero on the others."""
        import torch

        schedule = self._schedule(len(targets), training=True)
        self.last_microbatches = microbatches_for(len(targets), self.microbatches)
        args = (features,) if self.is_first else ()
        if not self.is_last:
            schedule.step(*args)
            return torch.zeros((), device=self.device)
        losses: list[torch.Tensor] = []
        schedule.step(*args, target=targets, losses=losses)
        return torch.stack(losses).mean().detach()

    def __call__(self, features: torch.Tensor) -> torch.Tensor | None:
        """The model's outputs of one batch (forward only) on the last stage; None elsewhere."""
        schedule = self._schedule(len(features), training=False)
        outputs = schedule.eval(*((features,) if self.is_first else ()))
        return outputs if self.is_last else None

    def eval(self) -> Pipeline:
        self.module.eval()
        return self

    def train(self, mode: bool = True) -> Pipeline:
        self.module.train(mode)
        return self


# ------------------------------------------------------------------------------ communication


@dataclass(frozen=True)
class Communication:
    """What one training step of this rank sent: collectives (tp, as DTensor's
    ``CommDebugMode`` counts them) and point-to-point bytes (pp: activations forward, their
    gradients back, from the stage's input and output shapes)."""

    collectives: int = 0
    p2p_bytes: int = 0
    counts: tuple[tuple[str, int], ...] = ()


@contextlib.contextmanager
def measured(pipeline: Pipeline | None) -> Iterator[list[Communication]]:
    """Measure the one training step run inside: yields a list that holds its
    :class:`Communication` afterwards."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    sizes = {"out": 0, "in": 0}  # bytes of one microbatch's stage output and input
    result: list[Communication] = []
    handle = None
    if pipeline is not None:

        def record(module: Any, args: tuple[Any, ...], output: Any) -> None:
            if isinstance(output, torch.Tensor):
                sizes["out"] = output.numel() * output.element_size()
            if args and isinstance(args[0], torch.Tensor):
                sizes["in"] = args[0].numel() * args[0].element_size()

        handle = pipeline.module.register_forward_hook(record)
    # CommDebugMode's module tracker hooks autograd in a way the pipeline's own
    # torch.autograd.grad refuses; a pipeline (no DTensors) counts bytes only.
    mode = CommDebugMode() if pipeline is None else None
    try:
        with mode if mode is not None else contextlib.nullcontext(), warnings.catch_warnings():
            # the tracker's backward hooks warn once on a first layer whose input needs no grad
            warnings.filterwarnings("ignore", message="Full backward hook is firing")
            yield result
    finally:
        if handle is not None:
            handle.remove()
    p2p = 0
    if pipeline is not None:  # activations go forward, their gradients come back
        sent = (0 if pipeline.is_last else sizes["out"]) + (0 if pipeline.is_first else sizes["in"])
        p2p = sent * pipeline.last_microbatches
    found = mode.get_comm_counts() if mode is not None else {}
    counts = tuple(sorted((str(op), int(n)) for op, n in found.items()))
    result.append(Communication(sum(n for _, n in counts), p2p, counts))
