"""The services prefect-ml starts or joins beside the Ray cluster, and the processes it leaves
behind: a Prefect server on loopback (its quota on Ray flow runs, the deployments of
``deployments/prefect.yaml``), Prefect automations that alert an unattended pipeline, Ray
Serve's HAProxy ingress, the TLS certificates between Ray nodes and for HTTPS serving, and the
timeline of where a flow run's time goes.

Behind this face: ``_environment`` (what every prefect-ml process sets before Prefect loads),
``_prefect_server`` (the local server, its credentials and quota, deployments from
prefect.yaml), ``_alerts`` (the automations and the promotion event), ``_serve_ingress``
(HAProxy's variables, private folder and ports), ``_tls`` (certificates, generated with
``cryptography``; the one module that imports it), ``_processes`` (what a command starts ends
with it; orphans ended later) and ``_timeline`` (named moments of a flow run).
"""

from prefect_ml.integrations.services._alerts import (
    CHAMPION_AUTOMATION,
    FAILED_RUN_AUTOMATION,
    PROMOTED_EVENT,
    NotificationBlock,
    alert_ui_url,
    announce_promotion,
    ensure_automations,
    find_notification_block,
)
from prefect_ml.integrations.services._environment import prepare_process_environment
from prefect_ml.integrations.services._prefect_server import (
    DEFAULT_PREFECT_FILE,
    RAY_TAG,
    basic_auth_header,
    ephemeral_api_pid,
    local_server,
    mark_stopped,
    ray_quota,
    read_deployment_specs,
    register_deployments,
    registered_deployment_ids,
    require_server,
    run_logger,
    runner_deployments,
    server_auth_string,
    server_database,
    server_is_up,
    set_ray_quota,
    set_tag_quota,
    start_ephemeral_api,
    stop_ephemeral_api,
    take_over_from_work_pools,
    ui_url,
)
from prefect_ml.integrations.services._processes import (
    check_port_free,
    descendant_pids,
    end_orphans,
    record_child,
    stop_descendants,
)
from prefect_ml.integrations.services._serve_ingress import (
    SERVE_INGRESS_ENVIRONMENT,
    check_haproxy_ports,
    haproxy_on_loopback,
    haproxy_private_paths,
)
from prefect_ml.integrations.services._timeline import Moment, Timeline, mark, recording, start_up
from prefect_ml.integrations.services._tls import (
    TLSFiles,
    certificate_hosts,
    generate_tls_files,
    local_hosts,
    ray_environment,
    trusting,
)

__all__ = [
    "CHAMPION_AUTOMATION",
    "DEFAULT_PREFECT_FILE",
    "FAILED_RUN_AUTOMATION",
    "PROMOTED_EVENT",
    "RAY_TAG",
    "SERVE_INGRESS_ENVIRONMENT",
    "Moment",
    "NotificationBlock",
    "TLSFiles",
    "Timeline",
    "alert_ui_url",
    "announce_promotion",
    "basic_auth_header",
    "certificate_hosts",
    "check_haproxy_ports",
    "check_port_free",
    "descendant_pids",
    "end_orphans",
    "ensure_automations",
    "ephemeral_api_pid",
    "find_notification_block",
    "generate_tls_files",
    "haproxy_on_loopback",
    "haproxy_private_paths",
    "local_hosts",
    "local_server",
    "mark",
    "mark_stopped",
    "prepare_process_environment",
    "ray_environment",
    "ray_quota",
    "read_deployment_specs",
    "record_child",
    "recording",
    "register_deployments",
    "registered_deployment_ids",
    "require_server",
    "run_logger",
    "runner_deployments",
    "server_auth_string",
    "server_database",
    "server_is_up",
    "set_ray_quota",
    "set_tag_quota",
    "start_ephemeral_api",
    "start_up",
    "stop_descendants",
    "stop_ephemeral_api",
    "take_over_from_work_pools",
    "trusting",
    "ui_url",
]
