"""The serving section: address, batching, replicas and their resources, request limits and
the canary that compares a new version with the serving one."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, field_validator, model_validator

from prefect_ml.integrations import storage
from prefect_ml.integrations.config.resources import (
    CustomResources,
    Reserve,
    Reserving,
    accelerator_field,
    memory_field,
    resources_field,
)
from prefect_ml.integrations.errors import ConfigurationError

# Serving options that chose the bearer token; refused with what to set instead.
REMOVED_TOKEN_FIELDS = frozenset({"auth_token_env", "auth_token_secret"})
# What separates a registered model's name from a version (``name/3``) or alias (``name@a``)
# where a request selects one: a name holding either could not be selected.
SELECTION_SEPARATORS = ("/", "@")


def _names(value: Any) -> Any:
    """A comma-separated list (as a command-line flag gives it) as a list of names."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    return value


ModelNames = Annotated[list[str], BeforeValidator(_names)]


class CanaryPolicy(BaseModel):
    """When a canary is promoted: enough requests, and no worse than the serving version."""

    share: float = Field(gt=0, lt=1)
    window_s: float = Field(gt=0)
    min_requests: int = Field(ge=1)
    max_error_increase: float = Field(ge=0, le=1)
    max_latency_ratio: float = Field(ge=1)
    max_metric_drop: float = Field(ge=0)


class ServingParams(Reserving):
    """How the model is served: address, batching, replicas and their resources, request limits."""

    host: str = Field(
        "127.0.0.1",
        min_length=1,
        title="Host",
        description="Interface the HTTP proxy binds; any but loopback (0.0.0.0 exposes it) "
        "needs a bearer token, PREFECT_ML_SERVE_TOKEN or PREFECT_ML_SERVE_TOKEN_SECRET.",
    )
    port: int = Field(8000, ge=1, le=65535, title="Port", description="HTTP port.")
    app_name: str = Field(
        "prefect-ml",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        title="Application name",
        description="Ray Serve application; deploying the same name again rolls it.",
    )
    route_prefix: str = Field(
        "/", pattern=r"^/", title="Route prefix", description="URL path the application serves."
    )
    batching: bool = Field(
        True,
        title="Adaptive batching",
        description="Requests that arrive while the model runs go through it together in the "
        "next call; a request that finds the model idle runs at once.",
    )
    max_batch_size: int = Field(
        32, ge=1, title="Max batch size", description="Requests merged into one model call."
    )
    batch_wait_timeout_s: float = Field(
        0.0,
        ge=0,
        le=1,
        title="Batch wait under load (s)",
        description="How long a batch that formed while the model was busy, but is not full, "
        "may wait for more requests (0: never; an idle model never waits).",
    )
    batch_inline_below_s: float = Field(
        0.002,
        ge=0,
        le=1,
        title="Run fast model calls inline (s)",
        description="While the model's last call took less than this, the next runs on the "
        "replica's event loop, without the hand-off to the batcher's thread and back (which "
        "costs more than a sub-millisecond call); slower models run in the thread, so requests "
        "keep being received meanwhile. 0: always in the thread.",
    )
    min_replicas: Annotated[int, Reserve.COUNT] = Field(
        1, ge=1, title="Min replicas", description="Replicas always up."
    )
    max_replicas: int = Field(
        1, ge=1, title="Max replicas", description="Upper bound for autoscaling (> min enables it)."
    )
    target_ongoing_requests: float = Field(
        8,
        gt=0,
        title="Target ongoing requests",
        description="Autoscaling target: in-flight requests per replica.",
    )
    max_ongoing_requests: int = Field(
        64, ge=1, title="Max ongoing requests", description="In-flight requests per replica."
    )
    max_queued_requests: int = Field(
        512,
        ge=-1,
        title="Max queued requests",
        description="Requests waiting for a replica beyond which new ones get a 503 with "
        "Retry-After (-1: no limit).",
    )
    retry_after_s: float = Field(
        1.0, ge=0, title="Retry-After (s)", description="Retry-After of an overload 503."
    )
    access_log: bool = Field(
        True,
        title="Access log",
        description="Each replica logs one line per request (Ray Serve's access log, in the "
        "replica's log and the driver's terminal); off: none. A request that raises is logged "
        "with its traceback either way.",
    )
    request_timeout_s: float = Field(
        30.0,
        gt=0,
        title="Request body timeout (s)",
        description="A request whose body has not all arrived by then gets a 408 (slow clients "
        "cannot hold a replica).",
    )
    deploy_timeout_s: float = Field(
        120.0,
        gt=0,
        title="Deploy timeout (s)",
        description="Every replica must have loaded the model by then, or the deployment fails "
        "with the replica's error (a new application is removed; a roll keeps the old version); "
        "and the endpoint must answer through Ray Serve's proxy by then (one being started or "
        "replaced is waited for).",
    )
    replica_cpus: Annotated[float, Reserve.CPUS] = Field(
        1.0, gt=0, title="CPUs per replica", description="CPUs reserved."
    )
    replica_gpus: Annotated[float, Reserve.GPUS] = Field(
        0.0, ge=0, title="GPUs per replica", description="GPUs reserved; fractions share a GPU."
    )
    replica_accelerator_type: Annotated[str | None, Reserve.ACCELERATOR_TYPE] = accelerator_field(
        "GPU type per replica", "replicas", "replica_gpus"
    )
    inference_precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32",
        title="Inference precision",
        description="Autocast dtype of the forward pass on a GPU replica (bf16/fp16 need "
        "--replica-gpus); probabilities are returned as float32 either way.",
    )
    replica_memory_gb: Annotated[float | None, Reserve.MEMORY] = memory_field(
        "Memory per replica (GB)", "each replica"
    )
    replica_resources: Annotated[CustomResources, Reserve.CUSTOM] = resources_field(
        "Custom resources per replica", "replicas"
    )
    max_rows: int = Field(
        1024, ge=1, title="Max rows per request", description="Larger batches get a 413."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024,
        ge=1024,
        title="Max body (bytes)",
        description="Larger request bodies get a 413.",
    )
    max_models_per_replica: int = Field(
        3,
        ge=0,
        le=64,
        title="Other versions per replica",
        description="Versions a request may select (header serve_multiplexed_model_id: "
        "<name>/<version> or <name>@<alias>, or /v2/models/<name>/versions/<version>) that a "
        "replica keeps loaded besides the one it serves; one more unloads the least recently "
        "used (0: only the served version answers).",
    )
    other_models: ModelNames = Field(
        default_factory=list,
        title="Other registered models",
        description="Registered models, besides the served one, whose versions a request may "
        "select (comma-separated); each must exist when serving starts.",
    )
    smoke_test: bool = Field(
        True, title="Smoke request", description="Send one example request after deploying."
    )
    canary_share: float = Field(
        0.0,
        ge=0,
        lt=1,
        title="Canary share",
        description="When the application already serves another version of the model: the "
        "share of requests the new one answers while both are compared, before it takes them "
        "all or is rolled back (0: roll straight to 100%).",
    )
    canary_window_s: float = Field(
        300.0,
        gt=0,
        title="Canary window (s)",
        description="How long the canary is compared with the serving version (errors end it "
        "early).",
    )
    canary_min_requests: int = Field(
        20,
        ge=1,
        title="Canary min requests",
        description="Requests the canary must answer in the window to be judged; fewer roll it "
        "back.",
    )
    canary_max_error_increase: float = Field(
        0.01,
        ge=0,
        le=1,
        title="Canary max error increase",
        description="How much higher than the serving version's the canary's error rate may be "
        "(0.01: one point).",
    )
    canary_max_latency_ratio: float = Field(
        1.5,
        ge=1,
        title="Canary max latency ratio",
        description="How many times the serving version's p95 latency the canary's may be.",
    )
    canary_max_metric_drop: float = Field(
        0.02,
        ge=0,
        title="Canary max metric drop",
        description="On requests that carry labels: how much worse the canary's accuracy (or "
        "RMSE) may be.",
    )

    @field_validator("route_prefix")
    @classmethod
    def _check_route_prefix(cls, route_prefix: str) -> str:
        """No ``..`` or ``.`` segment (percent-encoded too) nor backslash: a tenant's route
        ``/<tenant><route>`` must stay under its tenant however a client resolves it."""
        try:
            storage.check_key(route_prefix.lstrip("/"))
        except ConfigurationError as exc:
            raise ValueError(f"{exc.message}; give a plain path such as /models") from None
        return route_prefix

    @field_validator("other_models")
    @classmethod
    def _check_other_models(cls, names: list[str]) -> list[str]:
        for name in names:
            if any(separator in name for separator in SELECTION_SEPARATORS):
                raise ValueError(
                    f"{name!r} holds '/' or '@', which a request uses to name a version or "
                    "alias (<name>/<version>, <name>@<alias>); give the registered model's name"
                )
        if len(set(names)) != len(names):
            raise ValueError(f"a registered model is named twice in {names}; name each once")
        return names

    @model_validator(mode="before")
    @classmethod
    def _refuse_token_parameters(cls, values: Any) -> Any:
        """The token and the variable or block it comes from are the operator's: a parameter
        that picked them could send any secret of the environment to a host it picks."""
        removed = sorted(set(values) & REMOVED_TOKEN_FIELDS) if isinstance(values, dict) else []
        if removed:
            raise ValueError(
                f"serving.{removed[0]} is no longer a parameter: the bearer token comes from "
                "the settings of the process that serves, PREFECT_ML_SERVE_TOKEN or "
                "PREFECT_ML_SERVE_TOKEN_SECRET (a Prefect Secret block's name); drop the option"
            )
        return values

    @model_validator(mode="after")
    def _check_serving(self) -> ServingParams:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas ({self.min_replicas}); "
                "raise --max-replicas"
            )
        if self.batching and self.max_ongoing_requests < self.max_batch_size:
            raise ValueError(
                f"max_ongoing_requests ({self.max_ongoing_requests}) is below max_batch_size "
                f"({self.max_batch_size}), so batches could never fill; raise "
                "--max-ongoing-requests or lower --max-batch-size"
            )
        if self.replica_accelerator_type and not self.replica_gpus:
            raise ValueError(
                "replica_accelerator_type places GPU replicas: set --replica-gpus as well"
            )
        if self.other_models and not self.max_models_per_replica:
            raise ValueError(
                f"other_models {self.other_models} can only be selected with "
                "max_models_per_replica of 1 or more (0 serves only the served version); "
                "raise --max-models-per-replica or drop --other-models"
            )
        if self.inference_precision != "fp32" and not self.replica_gpus:
            raise ValueError(
                f"inference_precision {self.inference_precision} needs a GPU replica: set "
                "--replica-gpus, or keep --inference-precision fp32"
            )
        return self

    def canary_policy(self) -> CanaryPolicy | None:
        """How a new version is compared with the serving one, or None to roll straight."""
        if not self.canary_share:
            return None
        return CanaryPolicy(
            share=self.canary_share,
            window_s=self.canary_window_s,
            min_requests=self.canary_min_requests,
            max_error_increase=self.canary_max_error_increase,
            max_latency_ratio=self.canary_max_latency_ratio,
            max_metric_drop=self.canary_max_metric_drop,
        )

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}{self.route_prefix.rstrip('/')}"
