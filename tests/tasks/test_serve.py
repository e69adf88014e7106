"""The serve step's checks that need no Ray: where the bearer token comes from and where it goes."""

from __future__ import annotations

import posixpath
import socket
from collections.abc import Iterator
from urllib.parse import unquote

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from prefect_ml.flows.serve import serve_model
from prefect_ml.integrations import tenancy
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.tasks.params import ServingParams
from prefect_ml.tasks.serve import bearer_token, in_tenant, is_loopback
from tests.flows.test_invalid_parameters import _assert_nothing_written

pytestmark = pytest.mark.empty_home  # each test asserts MLflow's database was never created

TOKEN = "t" * 32


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    """A port on loopback where an attacker waits for whatever is sent to it."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        yield server


def _nothing_arrived(listener: socket.socket) -> bool:
    try:
        listener.accept()[0].close()
    except BlockingIOError:
        return True
    return False


@pytest.mark.parametrize(
    "option", [{"auth_token_env": "AWS_SECRET_ACCESS_KEY"}, {"auth_token_secret": "any-block"}]
)
def test_a_parameter_cannot_choose_the_token_or_where_it_is_sent(
    home: PrefectMLSettings, listener: socket.socket, option: dict[str, str]
) -> None:
    """The attack of issue 36: a secret of the environment as the token, sent to a listener."""
    port = listener.getsockname()[1]
    serving = {**option, "host": "localhost", "port": port}
    state = serve_model(params={"serving": serving}, return_state=True)
    assert state.is_failed()
    message = str(state.message) + str(state.result(raise_on_failure=False))
    assert f"serving.{next(iter(option))} is no longer a parameter" in message
    assert "PREFECT_ML_SERVE_TOKEN" in message
    assert _nothing_arrived(listener)
    _assert_nothing_written(home)


def test_serving_beyond_loopback_without_a_token_is_refused_before_anything(
    home: PrefectMLSettings,
) -> None:
    state = serve_model(params={"serving": {"host": "0.0.0.0"}}, return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, ConfigurationError) and error.field == "serving.host"
    assert "PREFECT_ML_SERVE_TOKEN" in error.message and "--host 127.0.0.1" in error.message
    _assert_nothing_written(home)


def test_a_configured_token_that_is_missing_empty_or_short_is_an_error(
    home: PrefectMLSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert bearer_token(PrefectMLSettings()) is None
    monkeypatch.setenv("PREFECT_ML_SERVE_TOKEN", TOKEN)
    assert bearer_token(PrefectMLSettings()) == TOKEN
    for value, problem in (("", "has 0 bytes"), ("short", "has 5 bytes")):
        monkeypatch.setenv("PREFECT_ML_SERVE_TOKEN", value)
        with pytest.raises(ConfigurationError, match=problem) as refused:
            bearer_token(PrefectMLSettings())
        assert refused.value.field == "PREFECT_ML_SERVE_TOKEN"
    monkeypatch.setenv("PREFECT_ML_SERVE_TOKEN_SECRET", "no-such-block")
    with pytest.raises(ConfigurationError, match="no Prefect Secret block 'no-such-block'") as e:
        bearer_token(PrefectMLSettings())
    assert e.value.field == "PREFECT_ML_SERVE_TOKEN_SECRET"


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("localhost.example.com", False),
        ("127.0.0.1.nip.io", False),
    ],
)
def test_only_loopback_counts_as_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_the_tracking_database_password_never_appears_in_an_error_a_parameter_causes(
    home: PrefectMLSettings, postgres_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36, finding 9: a model name that does not exist quoted the tracking URI whole."""
    from sqlalchemy.engine import make_url

    # The session's PostgreSQL trusts loopback: the password is carried, never checked.
    url = make_url(postgres_database).set(password="PASSWORD")
    with_password = url.render_as_string(hide_password=False)
    for uri, expected in (
        (with_password, f"no registered model 'nope' in {url.drivername}://{url.username}:***@"),
        ("nosuch://user:PASSWORD@host/x", "'nosuch://user:***@host/x' is not an MLflow"),
    ):
        monkeypatch.setenv("PREFECT_ML_MLFLOW_TRACKING_URI", uri)
        state = serve_model(params={"model_name": "nope"}, return_state=True)
        message = str(state.message) + str(state.result(raise_on_failure=False))
        assert expected in message and "PASSWORD" not in message, message


@pytest.mark.parametrize(
    ("app_name", "route_prefix", "app", "route"),
    [
        ("prefect-ml", "/", "alice.prefect-ml", "/alice"),
        ("secured", "/secured/", "alice.secured", "/alice/secured"),
        ("bob.prefect-ml", "/bob", "alice.bob.prefect-ml", "/alice/bob"),  # bob's, by name
        ("alice.mine", "/", "alice.mine", "/alice"),  # qualified once
    ],
)
def test_a_tenant_s_application_and_route_are_in_its_namespace(
    app_name: str, route_prefix: str, app: str, route: str
) -> None:
    """Issue 36, finding 5: tenant alice deploying app_name 'prefect-ml' replaced bob's."""
    params = ServingParams(app_name=app_name, route_prefix=route_prefix)
    qualified = in_tenant(params, "alice")
    assert (qualified.app_name, qualified.route_prefix) == (app, route)
    assert qualified.url.endswith(f":8000{route}")
    assert in_tenant(params, None) == params


def test_a_tenant_s_requests_select_versions_of_its_own_models_only() -> None:
    """Issue 41, part 3: serving.other_models names models in the tenant's namespace, so a
    request to alice's application cannot select a version of bob's model."""
    params = ServingParams(other_models=["wine", "alice.iris", "bob.digits"])
    qualified = in_tenant(params, "alice")
    assert qualified.other_models == ["alice.wine", "alice.iris", "alice.bob.digits"]
    assert in_tenant(params, None).other_models == ["wine", "alice.iris", "bob.digits"]


def test_the_served_model_that_ray_s_actors_receive_holds_no_database_password(
    home: PrefectMLSettings, postgres_database: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36, finding 9: ``ServedModel.tracking_uri`` carried the MLflow database password
    into the arguments of every serving replica and batch scoring actor, which Ray records
    (pickled, as here) and its dashboard shows. The replica takes the password from its own
    node's setting, so the version still loads."""
    import cloudpickle
    from sqlalchemy.engine import make_url

    from prefect_ml.integrations.serving import load_predictor
    from prefect_ml.tasks.serve import resolve_served_model
    from tests.helpers import blobs, register_classifier

    url = make_url(postgres_database).set(password="PASSWORD")
    monkeypatch.setenv("PREFECT_ML_MLFLOW_TRACKING_URI", url.render_as_string(hide_password=False))
    features, labels = blobs(rows=60, features=4)
    register_classifier(PrefectMLSettings(), "shipped", features, labels, seed=0)
    served = resolve_served_model("shipped", "champion", None)
    assert b"PASSWORD" not in cloudpickle.dumps(served)
    assert served.tracking_uri.startswith(f"{url.drivername}://{url.username}:***@")
    predictor, _ = load_predictor(served)
    assert predictor is not None


_TENANT = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,8}", fullmatch=True)
_APP = st.one_of(
    st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,12}", fullmatch=True),
    st.sampled_from(["bob.prefect-ml", "alice.x", "a..b", "\u0430lice.x", "alice\uff0ex"]),
)
_ROUTE = st.one_of(
    st.from_regex(r"/[A-Za-z0-9._~%/-]{0,12}", fullmatch=True),
    st.sampled_from(["/", "/../bob", "/./bob", "//bob", "/%2e%2e/bob", "/..", "/\u2024\u2024/b"]),
)


@settings(max_examples=300, deadline=None)
@given(
    tenants=st.tuples(_TENANT, _TENANT),
    apps=st.tuples(_APP, _APP),
    routes=st.tuples(_ROUTE, _ROUTE),
)
@example(tenants=("alice", "bob"), apps=("x", "x"), routes=("/../bob", "/"))
def test_no_application_name_or_route_of_one_tenant_is_another_s(
    tenants: tuple[str, str], apps: tuple[str, str], routes: tuple[str, str]
) -> None:
    """Issue 36, finding 5, as a property: whatever application names and routes two tenants
    give, their applications differ and each route stays under its tenant's own segment (read
    as an HTTP client reads it, ``..`` and percent-encoding resolved)."""
    assume(tenants[0] != tenants[1])
    served = []
    for tenant, app, route in zip(tenants, apps, routes, strict=True):
        try:
            params = ServingParams(app_name=app, route_prefix=route)
        except ValueError:
            return  # refused when parameters are parsed
        served.append((tenant, in_tenant(params, tenant)))
    (first, one), (second, other) = served
    assert one.app_name != other.app_name
    for tenant, params in served:
        assert tenancy.owns(params.app_name, tenant)
        path = posixpath.normpath(unquote(unquote(params.route_prefix)))
        assert path == f"/{tenant}" or path.startswith(f"/{tenant}/"), params.route_prefix
