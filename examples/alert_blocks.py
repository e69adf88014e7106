"""The notification blocks alerts go through (docs/how-to/alerts.md): a Slack webhook, or any
receiver that takes JSON. Run it against your Prefect server (``PREFECT_API_URL``), then
``prefect-ml deploy --alert-block slack-webhook/ml-alerts`` (TYPE/NAME: both are named
``ml-alerts``)."""

from prefect.blocks.notifications import CustomWebhookNotificationBlock, SlackWebhook


def save_alert_blocks() -> None:
    """Save both blocks as ``ml-alerts``; running it again updates them."""
    SlackWebhook(url="https://hooks.slack.com/services/T0/B0/XXXX").save(
        "ml-alerts", overwrite=True
    )
    CustomWebhookNotificationBlock(
        name="ml-alerts",
        url="https://alerts.example.com/hook",
        json_data={"subject": "{{subject}}", "body": "{{body}}"},
    ).save("ml-alerts", overwrite=True)


if __name__ == "__main__":
    save_alert_blocks()
