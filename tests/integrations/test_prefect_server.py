"""The auth string of the server `prefect-ml ui` runs: generated once, private, reused, and sent
by this home's commands to that server only (the server itself: tests/e2e/test_prefect_ui.py);
and the ephemeral API a command starts early, which its flow runs then use."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.services import prepare_process_environment, server_auth_string
from prefect_ml.integrations.settings import PrefectMLSettings

CLIENT_VARIABLES = ("PREFECT_API_URL", "PREFECT_API_AUTH_STRING")


@pytest.fixture
def clean_client_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No server address or credentials from outside; whatever the test sets is undone after it
    (set first so that monkeypatch records the variables and removes them again)."""
    monkeypatch.delenv("PREFECT_SERVER_API_AUTH_STRING", raising=False)
    for variable in CLIENT_VARIABLES:
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)


def _record_running_server(home: PrefectMLSettings, api_url: str) -> None:
    home.prefect_home.mkdir(parents=True, exist_ok=True)
    record = {"api_url": api_url, "pid": os.getpid()}  # a live process
    home.local_server_file.write_text(json.dumps(record))


def test_a_generated_auth_string_is_strong_private_and_reused(
    home: PrefectMLSettings, clean_client_environment: None
) -> None:
    auth_string, generated = server_auth_string(home)
    assert generated
    user, _, password = auth_string.partition(":")
    assert user == "prefect-ml" and len(password) >= 43  # 32 random bytes, base64url
    assert home.local_server_auth_file.read_text() == auth_string
    assert stat.S_IMODE(home.local_server_auth_file.stat().st_mode) == 0o600
    assert server_auth_string(home) == (auth_string, False)  # shown once, then reused
    other_home = PrefectMLSettings(home=home.home_dir.parent / "other")
    assert server_auth_string(other_home)[0] != auth_string


def test_a_given_auth_string_wins_and_a_short_one_is_refused(
    home: PrefectMLSettings, clean_client_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_auth_string(home)
    home.local_server_auth_file.chmod(0o644)
    monkeypatch.setenv("PREFECT_SERVER_API_AUTH_STRING", "admin:a-long-enough-password")
    assert server_auth_string(home) == ("admin:a-long-enough-password", False)
    assert home.local_server_auth_file.read_text() == "admin:a-long-enough-password"
    assert stat.S_IMODE(home.local_server_auth_file.stat().st_mode) == 0o600
    monkeypatch.setenv("PREFECT_SERVER_API_AUTH_STRING", "admin:short")
    with pytest.raises(ConfigurationError, match="PREFECT_SERVER_API_AUTH_STRING.*16"):
        server_auth_string(home)


def test_commands_send_the_home_servers_auth_string_to_that_server(
    home: PrefectMLSettings, clean_client_environment: None
) -> None:
    auth_string, _ = server_auth_string(home)
    _record_running_server(home, "http://127.0.0.1:4311/api")
    prepare_process_environment(home)
    assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:4311/api"
    assert os.environ["PREFECT_API_AUTH_STRING"] == auth_string


def test_the_auth_string_never_goes_to_a_server_the_user_chose(
    home: PrefectMLSettings, clean_client_environment: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    server_auth_string(home)
    _record_running_server(home, "http://127.0.0.1:4311/api")
    monkeypatch.setenv("PREFECT_API_URL", "https://prefect.example.com/api")
    prepare_process_environment(home)
    assert os.environ["PREFECT_API_URL"] == "https://prefect.example.com/api"
    assert "PREFECT_API_AUTH_STRING" not in os.environ


EARLY_API_CHECK = """
from prefect.client.orchestration import get_client
from prefect.server.api.server import SubprocessASGIServer

from prefect_ml.integrations.services import start_ephemeral_api
from prefect_ml.integrations.settings import get_settings

start_ephemeral_api(get_settings())
server = SubprocessASGIServer()
process = server.server_process
with get_client(sync_client=True) as client:
    client.api_healthcheck()
    print(str(client.api_url).rstrip("/") == server.api_url, server.server_process is process)
"""


@pytest.mark.usefixtures("clean_client_environment")
def test_the_ephemeral_api_started_early_is_the_one_flow_runs_use(tmp_path: Path) -> None:
    environment = {
        **os.environ,
        "PREFECT_HOME": str(tmp_path / "prefect"),
        "PREFECT_ML_HOME": str(tmp_path),
    }
    used = subprocess.run(
        [sys.executable, "-c", EARLY_API_CHECK],
        env=environment,
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    assert used.stdout.split() == ["True", "True"], used.stderr
