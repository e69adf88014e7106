"""The optimiser and the learning-rate schedulers a run steps: the model's
``configure_optimizers()`` in every form Lightning accepts, else the training section's.

Lightning 2's rules (``lightning.pytorch.core.optimizer._configure_optimizers`` and
``_configure_schedulers_automatic_opt``; ``_TrainingEpochLoop._update_learning_rates``):
``configure_optimizers`` returns an optimizer, a list of them, ``(optimizers, schedulers)``,
``{"optimizer": ..., "lr_scheduler": ..., "monitor": ...}`` or a list of such dicts; a scheduler
is a torch scheduler or a config dict (``scheduler``, ``interval`` "epoch" or "step",
``frequency``, ``monitor``, ``strict``, ``name``). An ``"epoch"`` scheduler steps after every
``frequency``-th epoch (after validation), a ``"step"`` one after every ``frequency``-th batch of
an epoch; ``ReduceLROnPlateau`` steps on its ``monitor`` metric, which must exist. Lightning
trains several optimizers only with manual optimisation, which prefect-ml does not run: such a
model is refused, as is ``automatic_optimization = False``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.errors import ConfigurationError

if TYPE_CHECKING:
    import torch

FIELD = "model.configure_optimizers"
SCHEDULER_KEYS = {"scheduler", "name", "interval", "frequency", "reduce_on_plateau", "monitor"}
SCHEDULER_KEYS |= {"strict"}


@dataclass
class ScheduledLR:
    """One scheduler and when it steps (Lightning's ``LRSchedulerConfig``)."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    reduce_on_plateau: bool = False
    monitor: str | None = None
    strict: bool = True
    name: str | None = None


@dataclass
class Optimization:
    """The run's optimiser and its schedulers; ``step_hook`` is the model's
    ``lr_scheduler_step(scheduler, metric)`` if it defines one."""

    optimizer: torch.optim.Optimizer
    schedulers: list[ScheduledLR] = field(default_factory=list)
    step_hook: Callable[[Any, Any], None] | None = None

    @property
    def lr(self) -> float:
        """The learning rate of the optimiser's first parameter group."""
        return float(self.optimizer.param_groups[0]["lr"])

    def after_batch(self, batch_idx: int) -> None:
        """Step the ``"step"`` schedulers due after batch ``batch_idx`` of the epoch."""
        for config in self.schedulers:
            if config.interval == "step" and not config.reduce_on_plateau:
                if (batch_idx + 1) % config.frequency == 0:
                    self._step(config, None)

    def after_epoch(self, epoch: int, batches: int, metrics: Mapping[str, float]) -> None:
        """Step the schedulers due after ``epoch`` (1-based) of ``batches`` batches: every
        ``"epoch"`` one, and plateau schedulers on their monitor (``metrics``: the epoch's, the
        same on every worker)."""
        for config in self.schedulers:
            counted = epoch if config.interval == "epoch" else batches
            if config.interval == "step" and not config.reduce_on_plateau:
                continue
            if counted % config.frequency:
                continue
            metric = None
            if config.reduce_on_plateau:
                assert config.monitor is not None
                if config.monitor not in metrics:
                    if not config.strict:
                        continue
                    raise ConfigurationError(
                        FIELD,
                        f"ReduceLROnPlateau monitors {config.monitor!r}, which the epoch's "
                        f"metrics do not have ({sorted(metrics)}); set 'monitor' to one of them",
                    )
                metric = metrics[config.monitor]
            self._step(config, metric)

    def _step(self, config: ScheduledLR, metric: float | None) -> None:
        if self.step_hook is not None:
            self.step_hook(config.scheduler, metric)
        elif metric is None:
            config.scheduler.step()
        else:
            config.scheduler.step(metric)

    def state_dict(self) -> list[dict[str, Any]]:
        return [config.scheduler.state_dict() for config in self.schedulers]

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        for config, state in zip(self.schedulers, states, strict=False):
            config.scheduler.load_state_dict(state)


def configured(model: Any) -> Optimization | None:
    """The model's ``configure_optimizers()`` as an :class:`Optimization`; None without the
    hook.

    Raises:
        ConfigurationError: a form Lightning refuses, several optimisers or manual
            optimisation (which prefect-ml does not run), or a scheduler that is not one.
    """
    import torch

    hook = getattr(model, "configure_optimizers", None)
    if not callable(hook):
        return None
    what = type(model).__name__
    if getattr(model, "automatic_optimization", True) is False:
        raise ConfigurationError(
            "model.automatic_optimization",
            f"{what} sets automatic_optimization = False; prefect-ml runs Lightning's automatic "
            "optimisation only (one optimizer, stepped after each training_step's loss): "
            "return the loss from training_step instead of calling manual_backward",
        )
    optimizers, schedulers, monitor = _forms(hook(), what)
    if len(optimizers) != 1:
        raise ConfigurationError(
            FIELD,
            f"{what}.configure_optimizers returns {len(optimizers)} optimizers; Lightning trains "
            "several only with manual optimisation, which prefect-ml does not support. Return "
            "one optimizer (its parameter groups can give parts of the model their own lr)",
        )
    optimizer = optimizers[0]
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            FIELD,
            f"{what}.configure_optimizers must return a torch optimizer, got "
            f"{type(optimizer).__name__}",
        )
    configs = [_scheduler_config(s, monitor, what) for s in schedulers]
    for config in configs:
        owner = getattr(config.scheduler, "optimizer", optimizer)
        if owner is not optimizer:
            raise ConfigurationError(
                FIELD,
                f"{what}.configure_optimizers returns a scheduler of another optimizer than "
                "the one it returns; build it on that optimizer",
            )
    own_step = getattr(type(model), "lr_scheduler_step", None)
    lightning_default = getattr(own_step, "__module__", "").startswith("lightning.")
    step_hook = None
    if callable(own_step) and not lightning_default:
        step_hook = model.lr_scheduler_step
    return Optimization(optimizer, configs, step_hook)


def _forms(returned: Any, what: str) -> tuple[list[Any], list[Any], str | None]:
    """``_configure_optimizers``: (optimizers, schedulers, monitor) of what the hook returned."""
    import torch

    def optimizer_like(value: Any) -> bool:
        return isinstance(value, torch.optim.Optimizer) or (
            callable(getattr(value, "step", None)) and hasattr(value, "param_groups")
        )

    if optimizer_like(returned):
        return [returned], [], None
    if (
        isinstance(returned, list | tuple)
        and len(returned) == 2
        and isinstance(returned[0], list)
        and all(optimizer_like(o) for o in returned[0])
    ):
        optimizers, schedulers = returned
        return list(optimizers), schedulers if isinstance(schedulers, list) else [schedulers], None
    if isinstance(returned, Mapping):
        _check_dict(returned, what)
        scheduler = [returned["lr_scheduler"]] if "lr_scheduler" in returned else []
        return [returned["optimizer"]], scheduler, returned.get("monitor")
    if (
        isinstance(returned, list | tuple)
        and returned
        and all(isinstance(d, Mapping) for d in returned)
    ):
        for item in returned:
            _check_dict(item, what)
        schedulers = [d["lr_scheduler"] for d in returned if "lr_scheduler" in d]
        return [d["optimizer"] for d in returned], schedulers, None
    if isinstance(returned, list | tuple) and returned and all(optimizer_like(o) for o in returned):
        return list(returned), [], None
    raise ConfigurationError(
        FIELD,
        f"{what}.configure_optimizers returned {type(returned).__name__}; return one of the "
        "forms Lightning accepts: an optimizer, [optimizer], ([optimizer], [scheduler]), or "
        '{"optimizer": optimizer, "lr_scheduler": scheduler or {"scheduler": ..., '
        '"interval": "epoch"|"step", "frequency": n, "monitor": metric}}',
    )


def _check_dict(returned: Mapping[str, Any], what: str) -> None:
    """``_validate_optim_conf``: an ``"optimizer"`` key, and no keys Lightning does not know."""
    unknown = set(returned) - {"optimizer", "lr_scheduler", "monitor"}
    if "optimizer" not in returned or unknown:
        raise ConfigurationError(
            FIELD,
            f"{what}.configure_optimizers returned a dict with keys {sorted(returned)}; it "
            "takes 'optimizer' and optionally 'lr_scheduler' and 'monitor'",
        )


def _scheduler_config(scheduler: Any, monitor: str | None, what: str) -> ScheduledLR:
    """``_configure_schedulers_automatic_opt``: one scheduler, or its config dict."""
    import torch

    plateau_type = torch.optim.lr_scheduler.ReduceLROnPlateau
    if isinstance(scheduler, Mapping):
        if "scheduler" not in scheduler:
            raise ConfigurationError(
                FIELD,
                f"{what}.configure_optimizers: the lr_scheduler dict needs the key 'scheduler' "
                "with the scheduler itself",
            )
        unknown = set(scheduler) - SCHEDULER_KEYS
        if unknown:
            raise ConfigurationError(
                FIELD,
                f"{what}.configure_optimizers: the lr_scheduler dict has keys {sorted(unknown)} "
                f"that Lightning does not know; use {sorted(SCHEDULER_KEYS)}",
            )
        config = ScheduledLR(**scheduler)
        if "reduce_on_plateau" not in scheduler:
            config.reduce_on_plateau = isinstance(config.scheduler, plateau_type)
    else:
        plateau = isinstance(scheduler, plateau_type)
        config = ScheduledLR(scheduler, reduce_on_plateau=plateau, monitor=monitor)
    if config.interval not in ("epoch", "step"):
        raise ConfigurationError(
            FIELD,
            f"{what}.configure_optimizers: the scheduler's interval must be 'epoch' or 'step', "
            f"not {config.interval!r}",
        )
    if not isinstance(config.frequency, int) or config.frequency < 1:
        raise ConfigurationError(
            FIELD,
            f"{what}.configure_optimizers: the scheduler's frequency must be a whole number "
            f"of at least 1, not {config.frequency!r}",
        )
    if config.reduce_on_plateau and config.monitor is None:
        raise ConfigurationError(
            FIELD,
            f"{what}.configure_optimizers returns a ReduceLROnPlateau without a monitor; return "
            '{"optimizer": ..., "lr_scheduler": {"scheduler": ..., "monitor": "val_loss"}}',
        )
    if not (
        callable(getattr(config.scheduler, "state_dict", None))
        and callable(getattr(config.scheduler, "step", None))
    ):
        raise ConfigurationError(
            FIELD,
            f"{what}.configure_optimizers returns {type(config.scheduler).__name__} as a "
            "scheduler; it needs step(), state_dict() and load_state_dict() (a torch "
            "scheduler)",
        )
    return config


def make_optimizer(name: str, params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The training section's optimiser: ``--optimizer`` with ``--lr`` and ``--weight-decay``."""
    import torch

    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)


def default(optimizer: torch.optim.Optimizer, scheduler: str, epochs: int) -> Optimization:
    """``optimizer`` with the training section's schedule (``--scheduler``): cosine over the
    epochs, or a constant rate; both step after each epoch."""
    import torch

    lr_scheduler: Any
    if scheduler == "cosine":
        lr_scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    else:
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    return Optimization(optimizer, [ScheduledLR(lr_scheduler)])
