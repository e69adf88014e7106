"""Every URL in a message is masked: no password of a setting reaches what a parameter prints."""

from __future__ import annotations

import pytest

from prefect_ml.integrations.redaction import masked


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("postgresql://user:PASSWORD@host:5432/db", "postgresql://user:***@host:5432/db"),
        ("postgresql+psycopg://u:PASSWORD@h/db", "postgresql+psycopg://u:***@h/db"),
        ("postgresql://u:PASS%40WORD@h/db", "postgresql://u:***@h/db"),
        ("mysql://u:PASS:WORD@h/d", "mysql://u:***@h/d"),
        ("postgresql://u:PASS@WORD@h/d", "postgresql://u:***@h/d"),
        ("http://admin:PASSWORD@mlflow:5000", "http://admin:***@mlflow:5000"),
        (
            "postgresql://u@h/db?sslmode=require&password=PASSWORD",
            "postgresql://u@h/db?sslmode=require&password=***",
        ),
        ("https://h/a.csv?X-Amz-Signature=PASSWORD&x=1", "https://h/a.csv?X-Amz-Signature=***&x=1"),
        ("postgresql://u:PASSWORD@h:notaport/db", "postgresql://u:***@h:notaport/db"),
        ("sqlite:////home/x/mlflow.db", "sqlite:////home/x/mlflow.db"),
        ("postgresql://user@host/db", "postgresql://user@host/db"),
        ("s3://bucket/key", "s3://bucket/key"),
        ("http://[::1", "http://[::1"),
    ],
)
def test_passwords_and_credential_parameters_are_masked_and_the_rest_kept(
    url: str, shown: str
) -> None:
    assert masked(url) == shown
    assert "PASS" not in masked(url)
