"""The container and cluster files, checked without Docker or Kubernetes.

What can go wrong in them without a daemon to say so: a COPY of a path that is not there, a
service that waits on one that does not exist, a port open beyond loopback, a password written
in the file, Serve settings that drifted from the ones the code uses locally.
"""

from __future__ import annotations

import fnmatch
import importlib.metadata
import json
import re
import shlex
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from integrations.settings import SERVE_INGRESS_ENVIRONMENT, PrefectMLSettings

REPO_ROOT = Path(__file__).resolve().parents[2]
DEPLOYMENTS = REPO_ROOT / "deployments"
COMPOSE_FILE = DEPLOYMENTS / "docker-compose.yml"
DOCKERFILE = DEPLOYMENTS / "Dockerfile"
RAY_CLUSTER_FILE = DEPLOYMENTS / "ray-cluster.yaml"
PREFECT_YAML = DEPLOYMENTS / "prefect.yaml"
DOCKERIGNORE = REPO_ROOT / ".dockerignore"

EXPECTED_SERVICES = {
    "postgres",
    "prefect-server",
    "minio",
    "minio-init",
    "mlflow",
    "ray-head",
    "worker",
}
RAY_NODE_SERVICES = ("ray-head", "worker")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|ACCESS_KEY")
# A compose substitution with a default that says it is for local development only.
DEV_DEFAULT_SUBSTITUTION = re.compile(r"\$\{[A-Z0-9_]+:-[^}]*dev[^}]*\}")
SUBSTITUTION = re.compile(r"\$\{([A-Z0-9_]+)(?::-([^}]*))?\}")
URL_USERINFO = re.compile(r"[a-z][a-z0-9+.-]*://([^/@\s]+)@")


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
    # The UIs the README points at: Prefect, MLflow, MinIO console, Ray dashboard.
    assert {4200, 5000, 9001, 8265} <= published


def test_compose_holds_no_literal_secrets(compose: dict[str, Any]) -> None:
    environments = {name: environment(s) for name, s in compose["services"].items()}
    secrets_seen = 0
    for name, env in environments.items():
        for key, value in env.items():
            if SECRET_NAME.search(key):
                secrets_seen += 1
                assert DEV_DEFAULT_SUBSTITUTION.fullmatch(value), (
                    f"{name}: {key} must be a ${{VAR:-...dev...}} substitution, not {value!r}"
                )
    assert secrets_seen >= 5
    # Passwords inside URLs (database URLs in environments and commands) too.
    urls_with_password = 0
    for text in all_strings(compose):
        for userinfo in URL_USERINFO.findall(text):
            _, _, password = userinfo.partition(":")
            urls_with_password += 1
            assert DEV_DEFAULT_SUBSTITUTION.fullmatch(password), f"literal password in {text!r}"
    assert urls_with_password >= 3


def test_compose_substitutions_agree_on_their_defaults() -> None:
    """A variable with two different defaults would give, say, MinIO and its clients different
    keys whenever the .env file does not set it."""
    defaults: dict[str, set[str]] = {}
    for variable, default in SUBSTITUTION.findall(COMPOSE_FILE.read_text()):
        defaults.setdefault(variable, set()).add(default)
    assert "POSTGRES_PASSWORD" in defaults
    disagreeing = {variable: d for variable, d in defaults.items() if len(d) > 1}
    assert not disagreeing, f"different defaults for: {disagreeing}"


def test_compose_s3_clients_use_the_minio_credentials(services: dict[str, dict[str, Any]]) -> None:
    minio = environment(services["minio"])
    for name in ("mlflow", "ray-head", "worker"):
        env = environment(services[name])
        assert env["AWS_ACCESS_KEY_ID"] == minio["MINIO_ROOT_USER"], name
        assert env["AWS_SECRET_ACCESS_KEY"] == minio["MINIO_ROOT_PASSWORD"], name


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
        url for text in all_strings(services) for url in re.findall(r"postgresql\S*://\S+", text)
    ]
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
    assert {"pyproject.toml", "README.md", "flows/", "tasks/", "integrations/"} <= set(sources)
    patterns = dockerignore_patterns()
    for source in sources:
        assert (REPO_ROOT / source).exists(), f"COPY {source}: not in the repo"
        assert not ignored(source, patterns), f"COPY {source}: excluded by .dockerignore"


def test_dockerfile_pins_torch_and_installs_the_database_drivers() -> None:
    runs = [arguments for keyword, arguments in dockerfile_instructions() if keyword == "RUN"]
    assert any(re.search(r"pip install torch==2\.13\.0(\s|$)", run) for run in runs)
    assert any("psycopg2" in run and "boto3" in run for run in runs)


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
    """prefect.yaml's entrypoints are paths relative to the project root (the WORKDIR)."""
    copied = {source.rstrip("/") for source in copy_sources()}
    entrypoints = [d["entrypoint"] for d in load_yaml(PREFECT_YAML)["deployments"]]
    assert entrypoints
    for entrypoint in entrypoints:
        path = entrypoint.split(":")[0]
        assert (REPO_ROOT / path).is_file(), entrypoint
        assert Path(path).parts[0] in copied, f"{entrypoint} is not copied into the image"


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
