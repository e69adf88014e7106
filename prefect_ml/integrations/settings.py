"""Environment settings (prefix ``PREFECT_ML_``); every embedded default lives under one home."""

from __future__ import annotations

import json
import os
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prefect_ml.integrations import tenancy
from prefect_ml.integrations.errors import ConfigurationError

MIN_KEY_BYTES = 32  # of a signing key: guessing one is out of reach


class PrefectMLSettings(BaseSettings):
    """Where prefect-ml keeps its state and which services it talks to.

    Unset services fall back to embedded defaults under ``home``, so ``rm -rf .prefect-ml``
    resets everything. The ecosystem's own variables (``MLFLOW_TRACKING_URI``) win over defaults.
    """

    model_config = SettingsConfigDict(env_prefix="PREFECT_ML_", extra="ignore")

    home: Path = Field(
        default=Path(".prefect-ml"),
        title="Project home",
        description="Directory holding all embedded state (MLflow, storage, Prefect, Ray runs).",
    )
    ray_address: str | None = Field(
        default=None,
        title="Ray address",
        description="Address of a running Ray cluster (e.g. ray://head:10001 or auto); "
        "unset starts a local Ray on this machine.",
    )
    storage_url: str | None = Field(
        default=None,
        title="Storage URL",
        description="fsspec URL for datasets and checkpoints; default file://<home>/storage.",
    )
    mlflow_tracking_uri: str | None = Field(
        default=None,
        title="MLflow tracking URI",
        description="Overrides MLFLOW_TRACKING_URI; default sqlite:///<home>/mlflow.db.",
    )
    optuna_storage: str | None = Field(
        default=None,
        title="Optuna storage",
        description="Where campaigns keep their studies: an SQLAlchemy URL "
        "(postgresql://..., sqlite:///...) or the path of an Optuna journal file; "
        "default sqlite:///<home>/optuna.db.",
    )
    ship_code: Literal["auto", "always", "never"] = Field(
        default="auto",
        title="Ship code to the cluster",
        description="With PREFECT_ML_RAY_ADDRESS: 'always' ships prefect-ml and the allowed user "
        "modules with every Ray job (runtime_env py_modules); 'never' uses what the nodes have "
        "installed; 'auto' ships unless this prefect-ml is an installed release that every node "
        "has in the same version. User modules from a source folder are shipped in every mode.",
    )
    worker_group_start_timeout_s: float = Field(
        default=60.0,
        gt=0,
        title="Worker group start timeout (s)",
        description="How long Ray Train waits for a worker group to be placed before it decides "
        "again (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S in every job). After a lost node an "
        "elastic group first asks for the workers the lost node held, until this runs out.",
    )
    controller_failure_limit: int = Field(
        default=2,
        ge=0,
        le=100,
        title="Worker group starts that may fail in a row",
        description="A training's worker group that fails to start (not placed within the "
        "worker group start timeout, or a worker that died while starting) is tried again at "
        "most this many times in a row before the run ends with the reason; a group that "
        "starts resets the count. Ray Train's own default retries for ever.",
    )
    max_shipped_mb: float = Field(
        default=100.0,
        gt=0,
        title="Largest code to ship (MB)",
        description="Refuse to ship a package bigger than this (data or build outputs inside a "
        "source folder are the usual cause); Ray's own limit is 512 MiB per job.",
    )
    data_layout: Literal["auto", "arrays", "parquet"] = Field(
        default="auto",
        title="How prepared splits are stored",
        description="'arrays': .npy splits each worker reads whole (fast for data that fits); "
        "'parquet': Parquet shards written by Ray Data and streamed by the workers (a tabular "
        "dataset only); 'auto': parquet for a tabular dataset whose files add up to at least "
        "PREFECT_ML_STREAM_MIN_MB, else arrays.",
    )
    stream_min_mb: float = Field(
        default=256.0,
        ge=0,
        title="Smallest tabular dataset streamed (MB)",
        description="With PREFECT_ML_DATA_LAYOUT=auto: a tabular dataset this big or bigger "
        "is prepared and trained on as a stream.",
    )
    prefect_database_url: SecretStr | None = Field(
        default=None,
        title="Prefect server database",
        description="Database of the Prefect server that `prefect-ml ui` starts: "
        "postgresql://user:password@host:5432/db (Prefect drives it with asyncpg) or "
        "sqlite+aiosqlite:///<file>; default SQLite under <home>/prefect. Passed to the server "
        "as PREFECT_API_DATABASE_CONNECTION_URL.",
    )
    s3_credentials_block: str | None = Field(
        default=None,
        title="S3 credentials block",
        description="Name of a Prefect Secret block holding a JSON object with "
        "aws_access_key_id and aws_secret_access_key (and optionally aws_session_token); "
        "unset uses the standard AWS chain (environment, AWS_PROFILE, instance role).",
    )
    alert_block: str | None = Field(
        default=None,
        title="Alert notification block",
        description="Name (or TYPE/NAME) of a Prefect notification block: `prefect-ml deploy` "
        "then creates automations that notify through it when a deployment's flow run fails "
        "or crashes and when a model becomes champion. `--alert-block` overrides it; unset: "
        "no alerts.",
    )
    s3_max_attempts: int = Field(
        default=6,
        ge=1,
        le=20,
        title="S3 attempts per request",
        description="Bound on botocore's retries (5xx, throttling, connection resets) with "
        "exponential backoff and jitter; errors past it are raised.",
    )
    task_retries: int = Field(
        default=2,
        ge=0,
        le=10,
        title="Retries of a failed step",
        description="How many times a data, training or campaign step that failed on a "
        "transient error is tried again; each retry resumes where the failed attempt stopped. "
        "Bad parameters and refused credentials are never retried. Read when the flows are "
        "imported (a deployment's or worker's environment).",
    )
    task_retry_delay_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        title="First retry delay (s)",
        description="Wait before the first retry; each further retry waits twice as long, "
        "give or take half (jitter).",
    )
    local_ray_cpus: int | None = Field(
        default=None,
        title="CPUs for a local Ray",
        description="CPUs a locally started Ray may use; unset uses every core.",
    )
    lease_expiry_s: float = Field(
        default=60.0,
        ge=1.0,
        le=3600.0,
        title="Lease expiry (seconds)",
        description="A training run or campaign has one writer, which renews a lease in the "
        "storage (and a campaign, a claim on its study in the study's database); a writer on "
        "another host that has not renewed it for this long (by the storage's or database's "
        "clock) is presumed dead and taken over. A dead writer on this host is taken over at "
        "once.",
    )
    check_resources: bool = Field(
        default=True,
        title="Check resources at flow start",
        description="Fail a flow at start when the Ray cluster cannot place its workers, trials "
        "or replicas; false (an autoscaling cluster that adds nodes on demand) only warns.",
    )
    tenant: str | None = Field(
        default=None,
        title="Tenant",
        description="Namespace of everything this process's runs create: MLflow experiments and "
        "registered models become '<tenant>.<name>' (aliases such as @champion are per tenant), "
        "campaigns '<tenant>.<name>', storage goes under '<storage>/tenants/<tenant>/', and "
        "training and campaign tasks carry the tag 'tenant:<tenant>'. Lower-case letters, "
        "digits, '-' and '_'. Unset: no namespace.",
    )
    tenant_ray_slots: int | None = Field(
        default=None,
        ge=0,
        title="Tenant's Ray slots",
        description="Training and campaign tasks of this tenant that may run at once: set at "
        "flow start as the Prefect concurrency limit on the tag 'tenant:<tenant>' (0 refuses "
        "them). Unset leaves the limit as an operator set it, or none.",
    )
    tenant_max_workers: int | None = Field(
        default=None,
        ge=1,
        title="Max workers per run",
        description="Training workers a run, and workers a campaign trial, may ask for.",
    )
    tenant_max_gpus: float | None = Field(
        default=None,
        ge=0,
        title="Max GPUs per run",
        description="GPUs a run may reserve at once: training workers x GPUs, trials at once x "
        "trial workers x trial GPUs, max replicas x replica GPUs.",
    )
    tenant_max_replicas: int | None = Field(
        default=None, ge=1, title="Max replicas", description="Serving replicas a run may ask for."
    )
    tenant_max_concurrent_trials: int | None = Field(
        default=None,
        ge=1,
        title="Max concurrent trials",
        description="Campaign trials a run may run at once (sweep.concurrency).",
    )

    @field_validator("tenant")
    @classmethod
    def _check_tenant(cls, tenant: str | None) -> str | None:
        return None if tenant is None else tenancy.check_tenant(tenant)

    allowed_modules: str = Field(
        default="",
        title="Modules allowed as user code",
        description="Comma-separated module prefixes (e.g. 'my_project,acme.models') whose "
        "'module:function' datasets and models parameters may name; plug-ins registered under "
        "the 'prefect_ml.datasets' / 'prefect_ml.models' entry points are allowed too. Anything "
        "else is refused when parameters are parsed. Set it on every node that trains.",
    )
    extra_url_schemes: str = Field(
        default="",
        title="Extra data URL schemes",
        description="Comma-separated URL schemes allowed for data URLs beyond the built-in ones "
        "(file, s3, gs, abfs, az, memory...), e.g. 'https' to read datasets over HTTP(S).",
    )
    data_prefixes: str = Field(
        default="",
        title="Where data may be read and predictions written",
        description="Comma-separated URL prefixes or folders (e.g. 's3://lake/shared,/data') "
        "that data URLs and batch-prediction outputs may name, beyond the storage root (the "
        "tenant's folder with PREFECT_ML_TENANT). With this or a tenant set, every other place "
        "is refused when parameters are parsed; unset and without a tenant, any place but a "
        "tenant's folder. Set it wherever others start flows.",
    )
    checkpoint_key: SecretStr | None = Field(
        default=None,
        title="Checkpoint signing key",
        description="Secret for HMAC-SHA256 signatures of checkpoint manifests: when set, every "
        "manifest written is signed and a manifest without a valid signature is refused before "
        "any of its files is read. Give every node that trains the same key.",
    )
    ray_tls_dir: Path | None = Field(
        default=None,
        title="Ray TLS folder",
        description="Folder written by `prefect-ml tls` (ca.pem, node.pem, node-key.pem): when "
        "set, the local Ray started here and every connection to PREFECT_ML_RAY_ADDRESS use "
        "Ray's mutual TLS. Start the cluster's nodes with the same folder's RAY_TLS_* variables.",
    )
    serve_tls_cert: Path | None = Field(
        default=None,
        title="Serving HTTPS certificate",
        description="PEM certificate (e.g. serve.pem from `prefect-ml tls`) for the serving "
        "endpoint: when set with the key, models are served over HTTPS only.",
    )
    serve_tls_key: Path | None = Field(
        default=None,
        title="Serving HTTPS key",
        description="PEM private key of PREFECT_ML_SERVE_TLS_CERT (e.g. serve-key.pem).",
    )
    serve_ingress: Literal["haproxy", "proxy"] = Field(
        default="haproxy",
        title="Serving ingress",
        description="haproxy: Ray Serve's HAProxy ingress, about 3x the requests/s; its stats "
        "page (8404) and Prometheus metrics (9101) listen on loopback when a local Ray started "
        "by prefect-ml runs it, on every interface on a cluster started without prefect-ml's "
        "HAProxy script; proxy: Serve's own proxy, which listens on --host:--port only. Read "
        "where a local Ray starts; HTTPS serving always uses proxy.",
    )
    serve_token: SecretStr | None = Field(
        default=None,
        title="Serving bearer token",
        description="Bearer token (32 bytes or more) that requests to served models must "
        "carry; only its sha256 reaches the replicas. With neither this nor "
        "PREFECT_ML_SERVE_TOKEN_SECRET set, models are served on loopback only.",
    )
    serve_token_secret: str | None = Field(
        default=None,
        title="Serving token Secret block",
        description="Name of a Prefect Secret block holding the serving bearer token (wins over "
        "PREFECT_ML_SERVE_TOKEN).",
    )

    @field_validator("checkpoint_key")
    @classmethod
    def _check_checkpoint_key(cls, key: SecretStr | None) -> SecretStr | None:
        """A key set but empty would sign with a key everyone knows: refused, never "off"."""
        if key is not None and len(key.get_secret_value().strip().encode()) < MIN_KEY_BYTES:
            raise ConfigurationError(
                "PREFECT_ML_CHECKPOINT_KEY",
                f"the key has fewer than {MIN_KEY_BYTES} bytes; unset it, or set e.g. "
                "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'",
            )
        return key

    @property
    def allowed_module_prefixes(self) -> tuple[str, ...]:
        return _comma_list(self.allowed_modules)

    @property
    def allowed_data_prefixes(self) -> tuple[str, ...]:
        return _comma_list(self.data_prefixes)

    @property
    def allowed_extra_url_schemes(self) -> tuple[str, ...]:
        return tuple(scheme.lower() for scheme in _comma_list(self.extra_url_schemes))

    @property
    def default_tls_dir(self) -> Path:
        """Where `prefect-ml tls` writes its certificates unless told otherwise."""
        return self.home_dir / "tls"

    @property
    def serve_tls(self) -> tuple[Path, Path] | None:
        """(certificate, key) for HTTPS serving, or None when serving plain HTTP."""
        if (self.serve_tls_cert is None) != (self.serve_tls_key is None):
            raise ConfigurationError(
                "PREFECT_ML_SERVE_TLS_CERT",
                "set both PREFECT_ML_SERVE_TLS_CERT and PREFECT_ML_SERVE_TLS_KEY, or neither",
            )
        if self.serve_tls_cert is None or self.serve_tls_key is None:
            return None
        pair = (
            self.serve_tls_cert.expanduser().resolve(),
            self.serve_tls_key.expanduser().resolve(),
        )
        for path in pair:
            if not path.is_file():
                raise ConfigurationError(
                    "PREFECT_ML_SERVE_TLS_CERT",
                    f"{path} is missing; create it with `prefect-ml tls` or point the setting "
                    "at your certificate and key",
                )
        return pair

    @cached_property
    def home_dir(self) -> Path:
        return self.home.expanduser().resolve()

    @property
    def resolved_storage_url(self) -> str:
        return (self.storage_url or (self.home_dir / "storage").as_uri()).rstrip("/")

    @property
    def resolved_tracking_uri(self) -> str:
        return (
            self.mlflow_tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{self.home_dir / 'mlflow.db'}"
        )

    @property
    def mlflow_artifact_root(self) -> str | None:
        """Artifact root for experiments we create; None lets a remote MLflow server decide.

        Without a server, MLflow would put them in ``./mlruns`` of whatever directory the
        process runs in: with SQLite they go under the home, with a shared database (several
        hosts write it) into the storage, which those hosts share too.
        """
        tracking_uri = self.resolved_tracking_uri
        if tracking_uri.startswith("sqlite:///"):
            return (self.home_dir / "mlartifacts").as_uri()
        if tracking_uri.partition("://")[0].split("+")[0] in _DATABASE_SCHEMES:
            return f"{self.resolved_storage_url}/mlartifacts"
        return None

    @property
    def resolved_optuna_storage(self) -> str:
        return self.optuna_storage or f"sqlite:///{self.home_dir / 'optuna.db'}"

    @property
    def prefect_home(self) -> Path:
        return self.home_dir / "prefect"

    @property
    def prefect_server_database(self) -> str | None:
        """The database URL for ``prefect-ml ui``'s server with Prefect's async driver, or
        None for Prefect's default (SQLite under the home); a clear error for any other."""
        if self.prefect_database_url is None:
            return None
        url = self.prefect_database_url.get_secret_value()
        scheme, separator, rest = url.partition("://")
        if separator and scheme in ("postgresql", "postgresql+asyncpg"):
            return f"postgresql+asyncpg://{rest}"
        if separator and scheme == "sqlite+aiosqlite":
            return url
        raise ConfigurationError(
            "PREFECT_ML_PREFECT_DATABASE_URL",
            f"{f'{scheme}://' if separator else 'that'} is not a database a Prefect server "
            "runs on; use postgresql://user:password@host:5432/database or "
            "sqlite+aiosqlite:///<file>",
        )

    @property
    def local_server_file(self) -> Path:
        """Where ``prefect-ml ui`` records the server it runs, for other commands to find."""
        return self.prefect_home / "server.json"

    @property
    def local_server_auth_file(self) -> Path:
        """The basic-auth string of the server ``prefect-ml ui`` runs for this home (mode 0600),
        which this home's commands send to that server, and only to it."""
        return self.prefect_home / "auth_string"

    @property
    def ray_storage_url(self) -> str:
        """Where Ray Train keeps its own run state (not our checkpoints): beside the storage
        when that is an object store (every node reaches it), else under the home."""
        if (
            self.storage_url
            and "://" in self.storage_url
            and not self.storage_url.startswith("file://")
        ):
            return f"{self.resolved_storage_url}/ray_results"
        return (self.home_dir / "ray_results").as_uri()


# MLflow's own database stores (SQLAlchemy URLs); anything else is a server or a plug-in.
_DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


def _comma_list(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


# The settings last read, and the environment and working directory they were read from.
_last_read: tuple[tuple[object, ...], PrefectMLSettings] | None = None


def get_settings() -> PrefectMLSettings:
    """The settings of the environment as it is now: read again whenever a variable or the
    working directory (a relative home) changed since the last call, as tests and the CLI
    change them; otherwise the same object. Reading them costs about 5 ms, and a trial worker
    asks five times per trial (the allow-list of the model's import path, the checkpoint key)."""
    global _last_read
    key = (tuple(sorted(os.environ.items())), os.getcwd())
    last = _last_read
    if last is not None and last[0] == key:
        return last[1]
    settings = PrefectMLSettings()
    _last_read = (key, settings)
    return settings


def running_local_server(settings: PrefectMLSettings) -> str | None:
    """The API URL of the server ``prefect-ml ui`` runs for this home, if it is still alive."""
    try:
        record = json.loads(settings.local_server_file.read_text())
        os.kill(int(record["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(record["api_url"])


def local_server_auth_string(settings: PrefectMLSettings) -> str | None:
    """The auth string recorded for this home's ``prefect-ml ui`` server, if any."""
    try:
        return settings.local_server_auth_file.read_text().strip() or None
    except OSError:
        return None


# Set in this process (children inherit it) and in the runtime environment of every Ray job we
# start, whatever the user set: MLflow 3 unpickles models by default, and a pickled model runs
# code when it loads. Our models are logged as pt2 (torch.export), which loads without pickle.
ENFORCED_ENVIRONMENT = {"MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "false"}


def worker_environment(settings: PrefectMLSettings) -> dict[str, str]:
    """Variables a Ray job's workers need: the enforced ones, Ray Train's worker-group start
    timeout and the user-code allow-list (secrets such as the checkpoint key are not shipped)."""
    shipped = dict(ENFORCED_ENVIRONMENT)
    shipped["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = f"{settings.worker_group_start_timeout_s:g}"
    if settings.allowed_modules:
        shipped["PREFECT_ML_ALLOWED_MODULES"] = settings.allowed_modules
    return shipped
