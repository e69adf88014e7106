"""Alerts for an unattended pipeline: Prefect automations that notify through a notification
block when a deployment's flow run fails or crashes and when a model takes the champion alias,
and the event the registry step emits for the latter.

Both automations run on the Prefect server (its triggers and actions services), so alerts keep
coming while no prefect-ml process watches; ``prefect-ml deploy --alert-block`` creates them,
and running it again updates them by name instead of adding copies.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from uuid import UUID

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.services._prefect_server import run_logger, ui_url

if TYPE_CHECKING:
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.events.schemas.automations import AutomationCore

__all__ = [
    "CHAMPION_AUTOMATION",
    "FAILED_RUN_AUTOMATION",
    "PROMOTED_EVENT",
    "NotificationBlock",
    "announce_promotion",
    "ensure_automations",
    "find_notification_block",
]

PROMOTED_EVENT = "prefect-ml.model.promoted"
MODEL_RESOURCE_PREFIX = "prefect-ml.model."
FAILED_RUN_AUTOMATION = "prefect-ml: a deployment's flow run failed"
CHAMPION_AUTOMATION = "prefect-ml: a model became champion"
ALERT_BLOCK_FLAG = "--alert-block"
_HOW_TO_CREATE = (
    "create one in the Prefect UI (Blocks -> Add block -> e.g. Custom Webhook or Slack Webhook) "
    "or in code (CustomWebhookNotificationBlock(...).save('NAME')), then pass its name, or "
    "TYPE/NAME as `prefect block ls` shows it (docs/how-to/alerts.md)"
)


@dataclass(frozen=True)
class NotificationBlock:
    """A notification block document on the server: what the automations' actions name."""

    id: UUID
    reference: str  # block-type-slug/name, as Prefect's `Block.load` takes it


# ---------------------------------------------------------------------------------------------
# The block


def find_notification_block(reference: str) -> NotificationBlock:
    """The notification block named ``reference`` (``NAME`` or ``TYPE-SLUG/NAME``) on the
    current Prefect API.

    Raises:
        ConfigurationError: (naming ``--alert-block``) no such notification block, several
            of that name, or a block that refuses its own URL (below).
    """
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import BlockDocument

    slug, _, name = reference.rpartition("/")
    query: dict[str, Any] = {
        "block_documents": {"name": {"any_": [name]}, "is_anonymous": {"eq_": False}},
        "block_schemas": {"block_capabilities": {"all_": ["notify"]}},
        "include_secrets": True,  # the URL, for the private-address check below
    }
    if slug:
        query["block_types"] = {"slug": {"any_": [slug]}}
    with get_client(sync_client=True) as client:
        response = client.request("POST", "/block_documents/filter", json=query)
    found = BlockDocument.model_validate_list(response.json())
    if not found:
        raise ConfigurationError(
            ALERT_BLOCK_FLAG, f"no notification block named {reference!r}: {_HOW_TO_CREATE}"
        )
    references = sorted(_reference(document) for document in found)
    if len(found) > 1:
        raise ConfigurationError(
            ALERT_BLOCK_FLAG,
            f"several notification blocks are named {name!r}: pass one of {references}",
        )
    [document] = found
    _check_reachable_url(references[0], document.data)
    assert document.id is not None
    return NotificationBlock(id=document.id, reference=references[0])


def _reference(document: Any) -> str:
    slug = document.block_type.slug if document.block_type else "?"
    return f"{slug}/{document.name}"


def _check_reachable_url(reference: str, data: dict[str, Any]) -> None:
    """Fail now for a block that would refuse every alert: Prefect's webhook blocks with
    ``allow_private_urls`` false refuse URLs on private, loopback or unresolvable hosts
    (``validate_restricted_url``, its SSRF guard), and the server would only log that."""
    from prefect.utilities.urls import validate_restricted_url

    url = data.get("url")
    if data.get("allow_private_urls", True) or not isinstance(url, str):
        return
    try:
        validate_restricted_url(url)
    except ValueError as exc:
        raise ConfigurationError(
            ALERT_BLOCK_FLAG,
            f"block {reference} has allow_private_urls off and refuses its own URL ({exc}). For "
            "a receiver on your own network, turn allow_private_urls on for this block (only "
            "this block; the guard stays on for the others); else point it at a public URL",
        ) from None


# ---------------------------------------------------------------------------------------------
# The automations


def alert_ui_url(api_url: str) -> str:
    """The UI address alerts link to: ``PREFECT_UI_URL`` when set (the address people open,
    e.g. behind a proxy), else the UI of ``api_url``."""
    return (os.environ.get("PREFECT_UI_URL") or ui_url(api_url)).rstrip("/")


def failed_run_automation(
    block: NotificationBlock, deployment_ids: Sequence[UUID], ui: str
) -> AutomationCore:
    """Notify once per flow run of these deployments that ends Failed or Crashed."""
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    run = "{{ flow.name }}/{{ deployment.name }} run {{ flow_run.name }}"
    return AutomationCore(
        name=FAILED_RUN_AUTOMATION,
        description="Created by `prefect-ml deploy --alert-block`; rerunning it updates this.",
        enabled=True,
        trigger=EventTrigger(
            expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"},
            match={"prefect.resource.id": "prefect.flow-run.*"},
            match_related={
                "prefect.resource.role": "deployment",
                "prefect.resource.id": [f"prefect.deployment.{i}" for i in deployment_ids],
            },
            for_each={"prefect.resource.id"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            SendNotification(
                block_document_id=block.id,
                subject=f"prefect-ml: {run} {{{{ flow_run.state.name }}}}",
                body=(
                    f"Flow run {{{{ flow_run.name }}}} ({{{{ flow_run.id }}}}) of deployment "
                    "{{ flow.name }}/{{ deployment.name }} ended {{ flow_run.state.name }}: "
                    "{{ flow_run.state.message }}\n"
                    f"Open it: {ui}/runs/flow-run/{{{{ flow_run.id }}}}"
                ),
            )
        ],
    )


def champion_automation(block: NotificationBlock) -> AutomationCore:
    """Notify when a model version takes the alias (:func:`announce_promotion`'s event)."""
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    model = "{{ event.payload.model }}"
    return AutomationCore(
        name=CHAMPION_AUTOMATION,
        description="Created by `prefect-ml deploy --alert-block`; rerunning it updates this.",
        enabled=True,
        trigger=EventTrigger(
            expect={PROMOTED_EVENT},
            match={"prefect.resource.id": f"{MODEL_RESOURCE_PREFIX}*"},
            posture=Posture.Reactive,
            threshold=1,
            within=timedelta(0),
        ),
        actions=[
            SendNotification(
                block_document_id=block.id,
                subject=(
                    f"prefect-ml: {model} v{{{{ event.payload.version }}}} is the new "
                    "@{{ event.payload.alias }}"
                ),
                body=(
                    f"{model} v{{{{ event.payload.version }}}} took @{{{{ event.payload.alias }}}} "
                    "from {% if event.payload.previous_version %}"
                    "v{{ event.payload.previous_version }}"
                    "{% else %}no earlier version{% endif %}.\n"
                    "Reason: {{ event.payload.reason }}\n"
                    "MLflow run: {{ event.payload.run_id }}"
                ),
            )
        ],
    )


def ensure_automations(
    block: NotificationBlock, deployment_ids: Sequence[UUID], ui: str
) -> list[str]:
    """Create both automations, or update those of the same names (removing any copies);
    returns their names."""
    from prefect.client.orchestration import get_client

    wanted = [failed_run_automation(block, deployment_ids, ui), champion_automation(block)]
    with get_client(sync_client=True) as client:
        for automation in wanted:
            _create_or_update(client, automation)
    return [automation.name for automation in wanted]


def _create_or_update(client: SyncPrefectClient, automation: AutomationCore) -> None:
    existing = client.read_automations_by_name(automation.name)
    if not existing:
        client.create_automation(automation)
        return
    kept, *copies = existing
    client.update_automation(kept.id, automation)
    for copy in copies:
        client.delete_automation(copy.id)


# ---------------------------------------------------------------------------------------------
# The event


def announce_promotion(
    *,
    model: str,
    version: str,
    previous_version: str | None,
    alias: str,
    reason: str,
    run_id: str,
) -> None:
    """Emit :data:`PROMOTED_EVENT` for the model (resource ``prefect-ml.model.<name>``).

    Never fails the registration: Prefect's ``emit_event`` queues the event for a background
    worker (inside a run, it goes to the run's API, ephemeral or server, with the run as a
    related resource) and logs rather than raises when that API cannot take it; what it still
    raises (an event over the server's size limit) is logged here.
    """
    from prefect.events import emit_event

    try:
        emit_event(
            PROMOTED_EVENT,
            resource={
                "prefect.resource.id": f"{MODEL_RESOURCE_PREFIX}{model}",
                "prefect.resource.name": model,
            },
            payload={
                "model": model,
                "version": version,
                "previous_version": previous_version,
                "alias": alias,
                "reason": reason,
                "run_id": run_id,
            },
        )
    except Exception as exc:  # an alert is not worth a failed registration
        run_logger().warning("the %s event for %s was not sent: %s", PROMOTED_EVENT, model, exc)
