"""The alert automations and their block, on the session's real Prefect API (the test harness):
found by name, refused when missing or unusable, created once however often deploy runs."""

from __future__ import annotations

import uuid

import pytest
from prefect.blocks.notifications import CustomWebhookNotificationBlock
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.events.schemas.automations import Automation

from prefect_ml.integrations import services
from prefect_ml.integrations.errors import ConfigurationError

RECEIVER = "http://127.0.0.1:9/alerts"  # never called here: no automation fires in these tests


def _webhook_block(name: str, *, allow_private_urls: bool = True) -> None:
    CustomWebhookNotificationBlock(
        name="prefect-ml alerts",
        url=RECEIVER,
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
        allow_private_urls=allow_private_urls,
    ).save(name, overwrite=True)


def _automations(name: str) -> list[Automation]:
    with get_client(sync_client=True) as client:
        return list(client.read_automations_by_name(name))


def test_a_missing_block_fails_naming_the_flag_and_how_to_create_one() -> None:
    with pytest.raises(ConfigurationError) as raised:
        services.find_notification_block("no-such-alerts")
    assert raised.value.field == "--alert-block"
    assert "no notification block named 'no-such-alerts'" in raised.value.message
    assert "Custom Webhook" in raised.value.message
    assert "docs/how-to/alerts.md" in raised.value.message


def test_a_block_that_cannot_notify_is_not_an_alert_block() -> None:
    Secret(value="not a notifier").save("alerts-secret", overwrite=True)
    with pytest.raises(ConfigurationError, match="no notification block named"):
        services.find_notification_block("alerts-secret")


def test_the_block_is_found_by_name_or_by_type_and_name() -> None:
    _webhook_block("unit-alerts")
    by_name = services.find_notification_block("unit-alerts")
    assert by_name.reference == "custom-webhook/unit-alerts"
    assert services.find_notification_block("custom-webhook/unit-alerts") == by_name
    with pytest.raises(ConfigurationError, match="no notification block"):
        services.find_notification_block("slack-webhook/unit-alerts")


def test_a_block_whose_ssrf_guard_refuses_its_own_url_fails_before_anything_is_created() -> None:
    _webhook_block("guarded-alerts", allow_private_urls=False)
    with pytest.raises(ConfigurationError) as raised:
        services.find_notification_block("guarded-alerts")
    assert raised.value.field == "--alert-block"
    assert "allow_private_urls" in raised.value.message
    assert "private address 127.0.0.1" in raised.value.message


def test_creating_the_automations_again_updates_them_instead_of_adding_copies() -> None:
    _webhook_block("rerun-alerts")
    block = services.find_notification_block("rerun-alerts")
    first, second = [uuid.uuid4()], [uuid.uuid4(), uuid.uuid4()]
    names = services.ensure_automations(block, first, "http://127.0.0.1:4200")
    assert names == [services.FAILED_RUN_AUTOMATION, services.CHAMPION_AUTOMATION]
    assert services.ensure_automations(block, second, "http://127.0.0.1:4300") == names

    [failed] = _automations(services.FAILED_RUN_AUTOMATION)
    [champion] = _automations(services.CHAMPION_AUTOMATION)
    related = failed.trigger.match_related  # type: ignore[union-attr]
    assert related["prefect.resource.id"] == [f"prefect.deployment.{i}" for i in second]  # type: ignore[index]
    [notify] = failed.actions
    assert notify.block_document_id == block.id  # type: ignore[union-attr]
    assert "http://127.0.0.1:4300/runs/flow-run/{{ flow_run.id }}" in notify.body  # type: ignore[union-attr]
    assert champion.trigger.expect == {services.PROMOTED_EVENT}  # type: ignore[union-attr]
