"""The container and cluster files, checked without Docker or Kubernetes.

What can go wrong in them without a daemon to say so: a COPY of a path that is not there, a
service that waits on one that does not exist, a port open beyond loopback, a password written
in the file or given a default, a service without authentication or TLS, root keys on a worker,
Serve settings that drifted from the ones the code uses locally.
"""

from __future__ import annotations

import configparser
import fnmatch
import importlib.metadata
import json
import os
import re
import shlex
import shutil
import subprocess
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from prefect_ml.integrations.services import SERVE_INGRESS_ENVIRONMENT
from prefect_ml.integrations.settings import PrefectMLSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = REPO_ROOT / "deployments"
COMPOSE_FILE = DEPLOYMENTS / "docker-compose.yml"
DOCKERFILE = DEPLOYMENTS / "Dockerfile"
RAY_CLUSTER_FILE = DEPLOYMENTS / "ray-cluster.yaml"
PREFECT_YAML = DEPLOYMENTS / "prefect.yaml"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"
DEPLOYMENTS_README = DEPLOYMENTS / "README.md"
HAPROXY_CFG = DEPLOYMENTS / "haproxy" / "haproxy.cfg"
MLFLOW_AUTH_INI = DEPLOYMENTS / "mlflow" / "basic_auth.ini"

EXPECTED_SERVICES = {
    "postgres",
    "prefect-server",
    "minio",
    "minio-init",
    "mlflow",
    "mlflow-init",
    "proxy",
    "ray-head",
    "worker",
}
RAY_NODE_SERVICES = ("ray-head", "worker")
# Names of secrets (an access key id names a user: it is not one).
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH_STRING")
# A compose substitution without which compose refuses to start, saying what to set.
REQUIRED_SUBSTITUTION = re.compile(r"\$\{[A-Z0-9_]+:\?[^}]+\}")
SUBSTITUTION = re.compile(
    r"\$\$|\$\{(?P<name>[A-Z0-9_]+)(?:(?P<operator>:-|:\?)(?P<argument>[^}]*))?\}"
)
URL_USERINFO = re.compile(r"[a-z][a-z0-9+.-]*://((?:[^/@\s$]|\$\{[^}]*\})+)@")
# The UIs and APIs the host reaches through the TLS proxy, by their service and port.
PROXIED = {"prefect-server": 4200, "mlflow": 5000, "minio": 9001}


# --- helpers ----------------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return load_yaml(COMPOSE_FILE)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def ray_cluster() -> dict[str, Any]:
    return load_yaml(RAY_CLUSTER_FILE)  # type: ignore[no-any-return]


def command_text(service: dict[str, Any]) -> str:
    command = service.get("command", "")
    return " ".join(command) if isinstance(command, list) else str(command)


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): str(v) for k, v in env.items()}


def depends_on(service: dict[str, Any]) -> dict[str, str]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):
        return {name: "service_started" for name in deps}
    return {name: spec.get("condition", "service_started") for name, spec in deps.items()}


def all_strings(node: Any) -> list[str]:
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for key, value in node.items() for s in all_strings(key) + all_strings(value)]
    if isinstance(node, list):
        return [s for item in node for s in all_strings(item)]
    return []


def interpolate(text: str, env: Mapping[str, str]) -> tuple[str, list[str]]:
    """Compose's interpolation of ``${VAR}``, ``${VAR:-default}``, ``${VAR:?message}`` and
    ``$$``: the text, and the variables it refuses to start without (unset or empty)."""
    missing: list[str] = []

    def substitute(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$$"  # left as it is: it reaches the container's shell as `$`
        value = env.get(match["name"]) or ""
        if value:
            return value
        if match["operator"] == ":?":
            missing.append(match["name"])
        return match["argument"] if match["operator"] == ":-" else ""

    return SUBSTITUTION.sub(substitute, text), missing


def required_variables() -> set[str]:
    return set(interpolate(COMPOSE_FILE.read_text(), {})[1])


def documented_env_file() -> set[str]:
    """The variables of the `.env` example in deployments/README.md."""
    block = DEPLOYMENTS_README.read_text().split("# deployments/.env", 1)[1].split("```", 1)[0]
    return set(re.findall(r"^([A-Z0-9_]+)=", block, flags=re.MULTILINE))


def variable_of(value: str) -> str:
    """The variable a ``${VAR...}`` value substitutes."""
    match = SUBSTITUTION.fullmatch(value)
    assert match and match["name"], f"{value!r} is not a substitution"
    return match["name"]


def haproxy_sections() -> dict[str, list[str]]:
    """haproxy.cfg as {"frontend prefect": [its lines], ...}, comments dropped."""
    sections: dict[str, list[str]] = {}
    current: list[str] = []
    for raw in HAPROXY_CFG.read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line:
            continue
        if not line[0].isspace():
            current = sections.setdefault(line.strip(), [])
        else:
            current.append(line.strip())
    return sections


def prefect_yaml_pools() -> set[str]:
    document = load_yaml(PREFECT_YAML)
    return {deployment["work_pool"]["name"] for deployment in document["deployments"]}


def compose_pool(services: dict[str, dict[str, Any]]) -> str:
    match = re.search(r"prefect worker start --pool (\S+)", command_text(services["worker"]))
    assert match, "the worker service does not start a Prefect worker on a pool"
    return match.group(1)


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        keyword, _, arguments = (current + line).partition(" ")
        instructions.append((keyword.upper(), arguments.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return instructions


def copy_sources() -> list[str]:
    sources: list[str] = []
    for keyword, arguments in dockerfile_instructions():
        if keyword not in ("COPY", "ADD"):
            continue
        parts = json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)
        parts = [part for part in parts if not part.startswith("--")]
        sources.extend(parts[:-1])
    return sources


def dockerignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line.strip("/") for line in lines if line and not line.startswith("#")]


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether .dockerignore drops ``path`` (or a folder above it) from the build context."""
    parts = Path(path.rstrip("/")).parts
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        forms = {pattern, pattern.removeprefix("**/")}
        if any(fnmatch.fnmatchcase(c, form) for c in candidates for form in forms):
            return True
    return False


# --- every file parses ------------------------------------------------------------------------


def test_deployment_yaml_files_parse() -> None:
    files = sorted(DEPLOYMENTS.glob("*.y*ml"))
    assert {COMPOSE_FILE, RAY_CLUSTER_FILE} <= set(files)
    for path in files:
        document = load_yaml(path)
        assert isinstance(document, dict) and document, f"{path.name} is empty or not a mapping"


# --- docker-compose.yml -----------------------------------------------------------------------


def test_compose_defines_the_stack(services: dict[str, dict[str, Any]]) -> None:
    missing = EXPECTED_SERVICES - set(services)
    assert not missing, f"services missing from docker-compose.yml: {sorted(missing)}"


def test_compose_dependencies_exist_and_can_be_met(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        for target, condition in depends_on(service).items():
            assert target in services, f"{name} depends on undefined service {target!r}"
            assert target != name
            if condition == "service_healthy":
                assert (services[target].get("healthcheck") or {}).get("test"), (
                    f"{name} waits for {target} to be healthy, but {target} has no healthcheck"
                )
            if condition == "service_completed_successfully":
                assert "ports" not in services[target], f"{target} is not a one-shot job"


def test_compose_named_volumes_are_declared(compose: dict[str, Any]) -> None:
    declared = set(compose.get("volumes") or {})
    used = set()
    for service in compose["services"].values():
        for volume in service.get("volumes", []):
            source = volume.get("source") if isinstance(volume, dict) else volume.split(":")[0]
            if source and not source.startswith((".", "/", "~", "$")):
                used.add(source)
    assert used, "no named volumes: the stack would lose its databases on `down`"
    assert used <= declared, f"undeclared volumes: {sorted(used - declared)}"
    assert declared <= used, f"declared but unused volumes: {sorted(declared - used)}"


def test_compose_builds_the_project_dockerfile(services: dict[str, dict[str, Any]]) -> None:
    built = {name: s["build"] for name, s in services.items() if "build" in s}
    assert {"prefect-server", "mlflow", "ray-head", "worker"} <= set(built)
    for name, build in built.items():
        build = {"context": build} if isinstance(build, str) else build
        context = (COMPOSE_FILE.parent / build.get("context", ".")).resolve()
        dockerfile = context / build.get("dockerfile", "Dockerfile")
        assert context == REPO_ROOT, f"{name}: the Dockerfile's COPY paths are repo-relative"
        assert dockerfile.resolve() == DOCKERFILE.resolve(), f"{name}: builds {dockerfile}"
    # One image for all of them: the same Ray and Python on every Ray node.
    assert len({services[name]["image"] for name in built}) == 1


def test_compose_worker_registers_prefect_yaml_and_serves_its_pool(
    services: dict[str, dict[str, Any]],
) -> None:
    command = command_text(services["worker"])
    pool = compose_pool(services)
    assert "deploy --prefect-file deployments/prefect.yaml --all" in command
    assert f"work-pool create {pool} --type process" in command
    # `prefect deploy` runs before the worker, from the image's working dir (the project root).
    assert command.index("prefect-file") < command.index("prefect worker start")


def test_compose_work_pool_is_the_one_prefect_yaml_deploys_to(
    services: dict[str, dict[str, Any]],
) -> None:
    pools = prefect_yaml_pools()
    assert pools == {compose_pool(services)}, (
        f"deployments/prefect.yaml deploys to {sorted(pools)}, the compose worker serves "
        f"{compose_pool(services)!r}; they must be the same pool"
    )


def test_compose_work_pool_name_is_accepted_by_a_prefect_server(
    services: dict[str, dict[str, Any]],
) -> None:
    """The server refuses pool names that start with 'prefect' (reserved): ask a real one."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    pool = compose_pool(services)
    with get_client(sync_client=True) as client:
        created = client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        try:
            assert created.name == pool and created.type == "process"
        finally:
            client.delete_work_pool(pool)


def test_compose_publishes_ports_on_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    published = set()
    for name, service in services.items():
        for port in service.get("ports", []):
            if isinstance(port, dict):
                assert port.get("host_ip") == "127.0.0.1", f"{name}: {port}"
                published.add(int(port["target"]))
            else:
                assert str(port).startswith("127.0.0.1:"), (
                    f"{name} publishes {port} beyond loopback"
                )
                published.add(int(str(port).rsplit(":", 1)[1]))
    # The UIs docs/how-to/containers.md points at: Prefect, MLflow, MinIO console, Ray dashboard.
    assert {4200, 5000, 9001, 8265} <= published


def test_compose_holds_no_secret_and_no_default_for_one(compose: dict[str, Any]) -> None:
    environments = {name: environment(s) for name, s in compose["services"].items()}
    secrets_seen = 0
    for name, env in environments.items():
        for key, value in env.items():
            if SECRET_NAME.search(key):
                secrets_seen += 1
                assert REQUIRED_SUBSTITUTION.fullmatch(value), (
                    f"{name}: {key} must be a ${{VAR:?message}} substitution, not {value!r}"
                )
    assert secrets_seen >= 10
    # Passwords inside URLs (database URLs in environments and commands) too.
    urls_with_password = 0
    for text in all_strings(compose):
        for userinfo in URL_USERINFO.findall(text):
            _, _, password = userinfo.partition(":")
            urls_with_password += 1
            assert REQUIRED_SUBSTITUTION.fullmatch(password), f"literal password in {text!r}"
    assert urls_with_password >= 3
    for match in SUBSTITUTION.finditer(COMPOSE_FILE.read_text()):
        if match["name"] and SECRET_NAME.search(match["name"]):
            assert match["operator"] == ":?", f"{match[0]}: a secret without `:?`"


def test_compose_refuses_to_start_without_each_secret() -> None:
    """Compose's own interpolation rules, applied here (docker is not needed): with none of the
    variables set, every secret is reported; with all set, the file is complete."""
    required = required_variables()
    assert {
        "POSTGRES_PASSWORD",
        "MINIO_ROOT_USER",
        "MINIO_ROOT_PASSWORD",
        "MINIO_PIPELINE_SECRET_KEY",
        "MINIO_MLFLOW_SECRET_KEY",
        "RAY_AUTH_TOKEN",
        "PREFECT_API_AUTH_STRING",
        "MLFLOW_ADMIN_PASSWORD",
        "MLFLOW_PIPELINE_PASSWORD",
        "MLFLOW_FLASK_SECRET_KEY",
        "TLS_CERT_FILE",
        "TLS_KEY_FILE",
    } <= required
    for variable in required:
        given = {name: f"given-{name.lower()}" for name in required - {variable}}
        assert set(interpolate(COMPOSE_FILE.read_text(), given)[1]) == {variable}
    text, missing = interpolate(COMPOSE_FILE.read_text(), {name: "x" * 32 for name in required})
    assert not missing
    assert yaml.safe_load(text)["services"]


def test_compose_secrets_are_documented_in_the_env_file_example() -> None:
    documented = documented_env_file()
    assert required_variables() <= documented, (
        f"deployments/README.md's .env example lacks {sorted(required_variables() - documented)}"
    )


def _has_docker_compose() -> bool:
    if shutil.which("docker") is None:
        return False
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.skipif(not _has_docker_compose(), reason="docker compose is not installed")
def test_docker_compose_config_fails_without_the_secrets() -> None:
    env = {k: v for k, v in os.environ.items() if k not in required_variables()}
    finished = subprocess.run(  # --env-file: not a developer's deployments/.env
        ["docker", "compose", "--env-file", os.devnull, "-f", str(COMPOSE_FILE), "config"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert finished.returncode != 0
    assert "required variable" in finished.stderr and "set " in finished.stderr, finished.stderr


def test_compose_substitutions_agree_on_their_defaults() -> None:
    """A variable with two different defaults would give two services different values whenever
    the .env file does not set it; a required one must be required wherever it is used."""
    operators: dict[str, set[str]] = {}
    defaults: dict[str, set[str]] = {}
    for match in SUBSTITUTION.finditer(COMPOSE_FILE.read_text()):
        if match["name"]:
            operators.setdefault(match["name"], set()).add(match["operator"] or "")
            if match["operator"] == ":-":
                defaults.setdefault(match["name"], set()).add(match["argument"])
    assert "POSTGRES_PASSWORD" in operators
    disagreeing = {variable: d for variable, d in defaults.items() if len(d) > 1}
    assert not disagreeing, f"different defaults for: {disagreeing}"
    mixed = {variable: o for variable, o in operators.items() if ":?" in o and len(o) > 1}
    assert not mixed, f"required in one place, not in another: {mixed}"


def _minio_user_and_policy(init: dict[str, Any], user: str) -> tuple[str, dict[str, Any]]:
    """The variable of the secret key minio-init gives ``user``, and the policy attached to it."""
    command = command_text(init)
    added = re.search(rf'mc admin user add stack {re.escape(user)} "\$\$(\w+)"', command)
    assert added, f"minio-init does not create the MinIO user {user!r}"
    attached = re.search(rf"mc admin policy attach stack (\S+) --user {re.escape(user)}\b", command)
    assert attached, f"minio-init attaches no policy to {user!r}"
    created = re.search(rf"mc admin policy create stack {attached[1]} /policies/(\S+)", command)
    assert created, f"policy {attached[1]} is not created from a file"
    assert any(str(v).startswith("./minio:/policies") for v in init["volumes"])
    policy = json.loads((DEPLOYMENTS / "minio" / created[1]).read_text())
    return variable_of(environment(init)[added[1]]), policy


def _policy_buckets(policy: dict[str, Any]) -> set[str]:
    resources = [r for statement in policy["Statement"] for r in statement["Resource"]]
    assert all(statement["Effect"] == "Allow" for statement in policy["Statement"])
    assert not any(
        "*" in statement["Action"] or "s3:*" in statement["Action"]
        for statement in policy["Statement"]
    )
    return {r.removeprefix("arn:aws:s3:::").split("/")[0] for r in resources}


def test_compose_s3_clients_get_a_user_scoped_to_their_bucket_never_the_root_keys(
    services: dict[str, dict[str, Any]],
) -> None:
    root = {variable_of(v) for v in environment(services["minio"]).values()}
    assert root == {"MINIO_ROOT_USER", "MINIO_ROOT_PASSWORD"}
    for name, service in services.items():
        if name not in ("minio", "minio-init"):
            used = {m["name"] for text in all_strings(service) for m in SUBSTITUTION.finditer(text)}
            assert not used & root, f"{name} gets MinIO's root keys"
    artifacts = re.search(
        r"--artifacts-destination s3://([^/\s]+)", command_text(services["mlflow"])
    )
    assert artifacts
    clients = {
        "ray-head": urlsplit(environment(services["ray-head"])["PREFECT_ML_STORAGE_URL"]).netloc,
        "worker": urlsplit(environment(services["worker"])["PREFECT_ML_STORAGE_URL"]).netloc,
        "mlflow": artifacts[1],
    }
    for name, bucket in clients.items():
        env = environment(services[name])
        secret, policy = _minio_user_and_policy(services["minio-init"], env["AWS_ACCESS_KEY_ID"])
        assert variable_of(env["AWS_SECRET_ACCESS_KEY"]) == secret, name
        assert _policy_buckets(policy) == {bucket}, (
            f"{name}'s MinIO user reaches more than {bucket}"
        )


def test_compose_mlflow_runs_the_basic_auth_app_and_clients_use_their_own_user(
    services: dict[str, dict[str, Any]],
) -> None:
    mlflow = services["mlflow"]
    assert "mlflow server --app-name basic-auth" in command_text(mlflow)
    env = environment(mlflow)
    mounted = {v.split(":")[1]: v.split(":")[0] for v in mlflow["volumes"] if v.startswith("./")}
    assert (DEPLOYMENTS / mounted[env["MLFLOW_AUTH_CONFIG_PATH"]]).resolve() == MLFLOW_AUTH_INI
    config = configparser.ConfigParser()
    config.read(MLFLOW_AUTH_INI)
    assert config["mlflow"]["default_permission"] == "NO_PERMISSIONS"
    assert "admin_password" not in config["mlflow"], "the admin password comes from a variable"
    assert REQUIRED_SUBSTITUTION.fullmatch(env["MLFLOW_AUTH_ADMIN_PASSWORD"])
    admin = env["MLFLOW_AUTH_ADMIN_USERNAME"]
    # The pipeline's user, created by mlflow-init (as the admin) once MLflow is healthy.
    init = services["mlflow-init"]
    assert depends_on(init)["mlflow"] == "service_healthy"
    init_env = environment(init)
    assert init_env["MLFLOW_TRACKING_USERNAME"] == admin
    assert init_env["MLFLOW_TRACKING_PASSWORD"] == env["MLFLOW_AUTH_ADMIN_PASSWORD"]
    created = re.search(r'create_user\("([^"]+)", os\.environ\["(\w+)"\]\)', command_text(init))
    assert created
    for name in RAY_NODE_SERVICES:
        client = environment(services[name])
        assert client["MLFLOW_TRACKING_USERNAME"] == created[1] != admin, name
        assert client["MLFLOW_TRACKING_PASSWORD"] == init_env[created[2]], name
    assert depends_on(services["worker"])["mlflow-init"] == "service_completed_successfully"


def test_compose_prefect_server_and_its_clients_share_an_auth_string(
    services: dict[str, dict[str, Any]],
) -> None:
    server = environment(services["prefect-server"])["PREFECT_SERVER_API_AUTH_STRING"]
    assert REQUIRED_SUBSTITUTION.fullmatch(server)
    assert environment(services["worker"])["PREFECT_API_AUTH_STRING"] == server


def test_compose_uis_are_reached_over_tls_only(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    for name in PROXIED:
        assert "ports" not in services[name], f"{name} is published without TLS"
    proxy = services["proxy"]
    published = {int(str(port).rsplit(":", 1)[1]) for port in proxy["ports"]}
    assert published == set(PROXIED.values())
    assert {s["target"] for s in proxy["secrets"]} == {"tls.pem", "tls.pem.key"}
    for secret in compose["secrets"].values():
        assert REQUIRED_SUBSTITUTION.fullmatch(secret["file"]), secret
    sections = haproxy_sections()
    assert "user haproxy" in sections["global"], "HAProxy must not keep running as root"
    assert "timeout http-request 10s" in sections["defaults"]
    bound: dict[int, str] = {}
    for title, lines in sections.items():
        if title.startswith("frontend "):
            [bind] = [line for line in lines if line.startswith("bind ")]
            assert bind.endswith("ssl crt /run/secrets/tls.pem"), f"{title}: {bind}"
            [backend] = [line.split()[1] for line in lines if line.startswith("default_backend")]
            [server] = [
                line for line in sections[f"backend {backend}"] if line.startswith("server")
            ]
            bound[int(bind.split()[1].lstrip(":"))] = server.split()[2]
    assert bound == {port: f"{name}:{port}" for name, port in PROXIED.items()}
    ui_api = environment(services["prefect-server"])["PREFECT_UI_API_URL"]
    assert ui_api.startswith("https://127.0.0.1:"), "the browser calls the API through TLS"


def test_compose_buckets_and_databases_are_created(services: dict[str, dict[str, Any]]) -> None:
    buckets = re.findall(r"stack/([a-z0-9.-]+)", command_text(services["minio-init"]))
    artifacts = re.search(
        r"--artifacts-destination s3://([^/\s]+)", command_text(services["mlflow"])
    )
    assert artifacts, "MLflow does not keep its artifacts in S3"
    needed = {
        urlsplit(environment(services["worker"])["PREFECT_ML_STORAGE_URL"]).netloc,
        artifacts[1],
    }
    assert needed <= set(buckets), f"buckets used {needed}, created {buckets}"

    created = {environment(services["postgres"])["POSTGRES_DB"]}
    created |= set(
        re.findall(r"for db in ([\w ]+);", command_text(services["postgres-init"]))[0].split()
    )
    database_urls = [
        url
        for text in all_strings(services)
        for url in re.findall(r"postgresql\S*://(?:[^\s$]|\$\{[^}]*\})+", text)
    ]
    given = {variable: "secret" for variable in required_variables()}
    database_urls = [interpolate(url, given)[0] for url in database_urls]
    used = {urlsplit(url).path.strip("/") for url in database_urls}
    assert used == {"prefect", "mlflow", "optuna"}
    assert used <= created, f"databases used {used}, created {created}"
    assert all(urlsplit(url).hostname == "postgres" for url in database_urls)


def test_compose_worker_points_at_the_stack(services: dict[str, dict[str, Any]]) -> None:
    env = environment(services["worker"])
    api = urlsplit(env["PREFECT_API_URL"])
    assert (api.hostname, api.port, api.path) == ("prefect-server", 4200, "/api")
    assert "--port 4200" in command_text(services["prefect-server"])
    tracking = urlsplit(env["MLFLOW_TRACKING_URI"])
    assert tracking.hostname == "mlflow"
    assert f"--port {tracking.port}" in command_text(services["mlflow"])
    # ray.init("host:port") needs a raylet next to the driver: the worker joins as a node.
    ray_host, _, ray_port = env["PREFECT_ML_RAY_ADDRESS"].partition(":")
    assert ray_host == "ray-head"
    assert f"--port={ray_port}" in command_text(services["ray-head"])
    assert f"ray start --address={ray_host}:{ray_port}" in command_text(services["worker"])
    assert env["PREFECT_ML_OPTUNA_STORAGE"].startswith("postgresql://")


def test_compose_prefect_ml_variables_are_real_settings(
    services: dict[str, dict[str, Any]],
) -> None:
    fields = {name.upper() for name in PrefectMLSettings.model_fields}
    for name, service in services.items():
        for key in environment(service):
            if key.startswith("PREFECT_ML_"):
                assert key.removeprefix("PREFECT_ML_") in fields, f"{name}: unknown setting {key}"


@pytest.mark.parametrize("name", RAY_NODE_SERVICES)
def test_compose_ray_nodes_start_with_the_serve_ingress_environment(
    services: dict[str, dict[str, Any]], name: str
) -> None:
    env = environment(services[name])
    serve_env = {key: value for key, value in env.items() if key.startswith("RAY_SERVE_")}
    assert serve_env == SERVE_INGRESS_ENVIRONMENT
    assert env["RAY_AUTH_MODE"] == "token"


# --- Dockerfile and .dockerignore -------------------------------------------------------------


def test_dockerfile_copies_only_what_exists_and_is_not_ignored() -> None:
    sources = copy_sources()
    assert {"pyproject.toml", "README.md", "prefect_ml/"} <= set(sources)
    patterns = dockerignore_patterns()
    for source in sources:
        assert (REPO_ROOT / source).exists(), f"COPY {source}: not in the repo"
        assert not ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"


def test_dockerfile_pins_torch_and_installs_the_database_drivers() -> None:
    runs = [arguments for keyword, arguments in dockerfile_instructions() if keyword == "RUN"]
    assert any(re.search(r"pip install torch==2\.13\.0(\s|$)", run) for run in runs)
    assert any("pip install ." in run and "boto3" in run for run in runs)
    # postgresql:// (MLflow's and Optuna's stores in the compose file) is psycopg 3 with
    # SQLAlchemy 2.1; `pip install .` brings both.
    dependencies = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert {"psycopg[binary]", "sqlalchemy"} <= {
        re.split(r"[<>=]", requirement)[0] for requirement in dependencies["dependencies"]
    }
    assert "sqlalchemy>=2.1,<3" in dependencies["dependencies"]
    assert any("Flask-WTF" in run for run in runs), "MLflow's basic-auth app needs Flask-WTF"


def test_dockerfile_runs_as_a_non_root_user_with_its_home_as_a_volume() -> None:
    instructions = dockerfile_instructions()
    users = [arguments for keyword, arguments in instructions if keyword == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    env: dict[str, str] = {}
    for keyword, arguments in instructions:
        if keyword == "ENV":
            env.update(part.split("=", 1) for part in shlex.split(arguments))  # type: ignore[misc]
    assert env["PREFECT_ML_HOME"] == "/var/lib/prefect-ml"
    assert ("VOLUME", "/var/lib/prefect-ml") in instructions
    assert ("WORKDIR", "/opt/prefect-ml") in instructions


def test_dockerfile_image_holds_every_deployment_entrypoint() -> None:
    """prefect.yaml's entrypoints are paths relative to the project root (the WORKDIR): in a
    folder copied into the image, or, as ``flows/`` is, a link into the copied package that
    the image makes as the repository has it."""
    copied = {source.rstrip("/") for source in copy_sources()}
    runs = " ".join(
        arguments for keyword, arguments in dockerfile_instructions() if keyword == "RUN"
    )
    entrypoints = [d["entrypoint"] for d in load_yaml(PREFECT_YAML)["deployments"]]
    assert entrypoints
    for entrypoint in entrypoints:
        path = entrypoint.split(":")[0]
        assert (REPO_ROOT / path).is_file(), entrypoint
        top = REPO_ROOT / Path(path).parts[0]
        if top.is_symlink():
            target = top.readlink()
            assert f"ln -s {target.as_posix()} {top.name}" in runs, f"{entrypoint}: no link"
            top = Path(target.parts[0])
        assert top.name in copied, f"{entrypoint} is not copied into the image"


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    patterns = dockerignore_patterns()
    for path in (".venv", ".prefect-ml", ".git", "benchmarks/results", "x/mlruns", "mlflow.db"):
        assert ignored(path, patterns), f"{path} would be sent to the Docker daemon"


# --- ray-cluster.yaml -------------------------------------------------------------------------


def ray_containers(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    spec = cluster["spec"]
    groups = {"head": spec["headGroupSpec"]}
    groups |= {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    return {name: g["template"]["spec"]["containers"][0] for name, g in groups.items()}


def test_ray_cluster_is_a_kuberay_cluster(ray_cluster: dict[str, Any]) -> None:
    assert ray_cluster["apiVersion"] == "ray.io/v1"
    assert ray_cluster["kind"] == "RayCluster"
    assert ray_cluster["spec"]["rayVersion"] == importlib.metadata.version("ray")


def test_ray_cluster_start_params_are_strings(ray_cluster: dict[str, Any]) -> None:
    """KubeRay's CRD types rayStartParams as map[string]string: a bare number is rejected."""
    spec = ray_cluster["spec"]
    head_params = spec["headGroupSpec"]["rayStartParams"]
    assert head_params, "the head needs rayStartParams"
    assert head_params["dashboard-host"] == "0.0.0.0"
    assert spec["workerGroupSpecs"], "no worker group"
    for params in [head_params] + [g["rayStartParams"] for g in spec["workerGroupSpecs"]]:
        assert all(isinstance(value, str) for value in params.values()), params


def test_ray_cluster_runs_one_image_with_one_environment(ray_cluster: dict[str, Any]) -> None:
    containers = ray_containers(ray_cluster)
    head = containers.pop("head")
    for name, worker in containers.items():
        assert worker["image"] == head["image"], f"group {name} runs another image"
        assert worker["env"] == head["env"], f"group {name} has another environment"
        assert worker.get("envFrom") == head.get("envFrom")


def test_ray_cluster_nodes_start_with_the_serve_ingress_environment(
    ray_cluster: dict[str, Any],
) -> None:
    for name, container in ray_containers(ray_cluster).items():
        env = {item["name"]: item.get("value") for item in container["env"]}
        serve_env = {key: value for key, value in env.items() if key.startswith("RAY_SERVE_")}
        assert serve_env == SERVE_INGRESS_ENVIRONMENT, name
        assert env["RAY_AUTH_MODE"] == "token", name


def test_ray_cluster_containers_have_requests_and_limits(ray_cluster: dict[str, Any]) -> None:
    for name, container in ray_containers(ray_cluster).items():
        resources = container["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[kind]), f"{name}: {kind}"


def test_ray_cluster_takes_every_secret_from_a_kubernetes_secret(
    ray_cluster: dict[str, Any],
) -> None:
    for name, container in ray_containers(ray_cluster).items():
        env = {item["name"]: item for item in container["env"]}
        for key, item in env.items():
            if SECRET_NAME.search(key) or key == "MLFLOW_TRACKING_USERNAME":
                assert "value" not in item, f"{name}: {key} is written in the file"
                reference = item["valueFrom"]["secretKeyRef"]
                assert not reference.get("optional"), f"{name}: {key} may be missing"
        assert {"RAY_AUTH_TOKEN", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"} <= set(
            env
        )
        for source in container.get("envFrom", []):
            assert set(source) == {"secretRef"}, f"{name}: credentials from {source}"


RAY_TLS_VARIABLES = ("RAY_TLS_SERVER_CERT", "RAY_TLS_SERVER_KEY", "RAY_TLS_CA_CERT")


def test_compose_ray_nodes_talk_tls_with_certificates_from_secrets_at_fixed_addresses(
    compose: dict[str, Any], services: dict[str, dict[str, Any]]
) -> None:
    """Ray checks a node's certificate against its address: the nodes' addresses are fixed."""
    import ipaddress

    subnet = ipaddress.ip_network(compose["networks"]["default"]["ipam"]["config"][0]["subnet"])
    addresses = set()
    for name in ("ray-head", "worker"):
        service = services[name]
        env = service["environment"]
        assert env["RAY_USE_TLS"] == "1", name
        mounted = {f"/run/secrets/{secret}" for secret in service["secrets"]}
        assert {env[variable] for variable in RAY_TLS_VARIABLES} <= mounted, name
        address = ipaddress.ip_address(service["networks"]["default"]["ipv4_address"])
        assert address in subnet, name
        addresses.add(address)
    assert len(addresses) == 2
    for secret in ("ray_tls_ca", "ray_tls_node_cert", "ray_tls_node_key"):
        assert REQUIRED_SUBSTITUTION.fullmatch(compose["secrets"][secret]["file"]), secret


def test_ray_cluster_pods_talk_tls_with_a_certificate_for_their_own_ip(
    ray_cluster: dict[str, Any],
) -> None:
    """Each pod's init container signs a certificate for the pod's IP with the CA secret, and
    removes the CA key before Ray starts; the Ray container never mounts the CA secret."""
    spec = ray_cluster["spec"]
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group in groups:
        pod = group["template"]["spec"]
        ray = pod["containers"][0]
        env = {item["name"]: item.get("value") for item in ray["env"]}
        assert env["RAY_USE_TLS"] == "1"
        mounts = {m["name"]: m for m in ray["volumeMounts"]}
        assert "ray-ca" not in mounts and mounts["ray-tls"]["readOnly"]
        assert all(
            env[v].startswith(mounts["ray-tls"]["mountPath"] + "/") for v in RAY_TLS_VARIABLES
        )
        (init,) = pod["initContainers"]
        script = init["command"][-1]
        assert "prefect-ml tls --dir /etc/ray/tls" in script and '--host "$POD_IP"' in script
        assert script.rstrip().endswith("rm /etc/ray/tls/ca-key.pem")
        assert init["env"][0]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["ray-ca"]["secret"]["secretName"] == "prefect-ml-ray-ca"
        assert "emptyDir" in volumes["ray-tls"]
