"""The one error root of prefect-ml and its few specific kinds, and which errors of a worker's
code every retry meets again (what a Ray Train run and a campaign's trial pool do not retry)."""

from __future__ import annotations


class PrefectMLError(Exception):
    """Root of every error prefect-ml raises on purpose; the message says what to do next."""


class ConfigurationError(PrefectMLError, ValueError):
    """A parameter or setting is invalid; raised before any compute starts.

    Args:
        field: dotted name of the offending parameter, e.g. ``training.workers``.
        message: what is wrong and how to fix it.
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self) -> tuple[type[ConfigurationError], tuple[str, str]]:
        return (type(self), (self.field, self.message))


class CheckpointError(PrefectMLError):
    """No checkpoint could be verified where one was required."""


class EnvironmentCheckError(PrefectMLError):
    """A service prefect-ml needs (Ray, MLflow, storage) is unreachable or not writable."""


class DeploymentError(PrefectMLError):
    """A serving application did not come up (a replica failed to load or start)."""


class CampaignFailedError(PrefectMLError):
    """A campaign spent its budget and no trial completed; running it again concludes the same."""


class TrainingCodeError(PrefectMLError):
    """Training workers failed in a way every retry meets again (a worker's code raised, or
    the worker group cannot start): the run ends at once; the message names the node, the
    worker and the fix."""


class ModelStepError(PrefectMLError, ValueError):
    """The user's model failed its first training step (its forward or loss): an error of its
    code that every retry meets again, not one of the machine."""


# Errors of a worker's own code that the same code raises again on every attempt. Errors of
# the machine (OSError: storage, network, timeouts) and of torch.distributed (RuntimeError:
# a peer that died) are not among them.
DETERMINISTIC_ERRORS: tuple[type[BaseException], ...] = (
    ImportError,
    SyntaxError,
    NameError,
    AttributeError,
    TypeError,
    ValueError,
    LookupError,
    ArithmeticError,
    AssertionError,
    NotImplementedError,
    ConfigurationError,
)


def fix_for(error: BaseException, code: str) -> str:
    """What the user does about a worker's deterministic ``error`` in ``code`` (the model)."""
    if isinstance(error, ImportError):
        module = getattr(error, "name", None) or "the module"
        return (
            f"{module} cannot be imported on that node: install it there (pip install ... on "
            "every node, or in the nodes' image), or let the job ship it "
            "(PREFECT_ML_SHIP_CODE=always, and a module of your own listed in "
            "PREFECT_ML_ALLOWED_MODULES)"
        )
    return f"fix {code} so that it runs on the workers"
