"""Drive the Prefect 3 UI (the v1 Vue UI) through a deployment's custom run.

Deep links such as ``/deployments/deployment/<id>`` are always served by the v1 UI; only a bare
``/`` redirects to the v2 UI (``/v2``), which these selectors do not cover. The server must tell
the UI its own API address (PREFECT_SERVER_UI_API_URL or PREFECT_API_URL in its environment,
or PREFECT_SERVER_API_PORT matching ``--port``); otherwise the UI calls
http://127.0.0.1:4200/api and every page stays empty.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import quote

from playwright.sync_api import Error as PlaywrightError
from playwright.sync_api import Locator, Page, expect

# Labels are not tied to their inputs (``<label for>`` points at no id), so a form field is
# found by its title text and then this ancestor: the property block holding label and input.
_PROPERTY = (
    "xpath=ancestor::div[contains(concat(' ', normalize-space(@class), ' '),"
    " ' schema-form-property ')][1]"
)
_PROPERTY_BODY = "xpath=./div[contains(@class, 'p-label__body')]"
_DEPLOYMENT_RUNS_TAB_URL = re.compile(r"/deployments/deployment/[^/?]+\?tab=")
_FLOW_RUN_URL = re.compile(r"/runs/flow-run/([0-9a-f-]{36})")
_LOGIN_URL = re.compile(r"/login(\?|$)")
_TERMINAL_STATES = {"Completed", "Failed", "Crashed", "Cancelled", "TimedOut"}
# The toast Prefect's UI shows for an API answer of 5xx (or 401/403, or none), once a page: its
# server, on a loaded machine, answers 503 when its SQLite database is busy, an error it calls
# retryable (its own client retries it; nothing was created). The form is then submitted again.
_SERVER_ERROR_TOAST = "Oops. Something went wrong."
_SUBMIT_TRIES = 3
_ANSWER_TIMEOUT_MS = 120_000  # a create answers in seconds, on a loaded machine in tens
# The custom-run form's values as its Vue components hold them (the props of its SchemaInput),
# found by walking the mounted component tree from the app's root; null before it renders.
_FORM_VALUES = """() => {
  const pending = [document.querySelector('#app')._vnode];
  while (pending.length) {
    const vnode = pending.pop();
    if (!vnode || typeof vnode !== 'object') continue;
    const component = vnode.component;
    if (component && component.type.__name === 'SchemaInput') return component.props.values;
    if (component) pending.push(component.subTree);
    if (vnode.suspense) pending.push(vnode.suspense.activeBranch);
    if (Array.isArray(vnode.children)) pending.push(...vnode.children);
  }
  return null;
}"""
_FORM_HOLDS = f"""expected => {{
  const holds = (have, want) => want !== null && typeof want === 'object'
    ? have !== null && typeof have === 'object'
      && Object.entries(want).every(([key, value]) => holds(have[key], value))
    : have === want;
  return holds(({_FORM_VALUES})(), expected);
}}"""


@contextmanager
def screenshot_on_failure(page: Page, path: str | Path) -> Iterator[None]:
    """Save a full-page screenshot to ``path`` if the block raises, then re-raise."""
    try:
        yield
    except BaseException:
        with suppress(PlaywrightError):  # a closed page must not hide the original error
            page.screenshot(path=str(path), full_page=True)
        raise


def log_in(page: Page, ui_url: str, auth_string: str) -> None:
    """Open the UI, which sends a browser without credentials to its login page (the server
    runs with PREFECT_SERVER_API_AUTH_STRING), and log in with the auth string."""
    page.goto(ui_url)
    page.wait_for_url(_LOGIN_URL)
    page.get_by_placeholder("admin:pass").fill(auth_string)
    page.get_by_role("button", name="Login", exact=True).click()
    page.wait_for_url(lambda url: not _LOGIN_URL.search(url))


def _api_headers(page: Page) -> dict[str, str]:
    """The Authorization header the logged-in UI sends (it keeps the token in localStorage)."""
    token = page.evaluate("() => localStorage.getItem('prefect-password')")
    return {"Authorization": f"Basic {token}"} if token else {}


def open_custom_run(page: Page, ui_url: str, flow_name: str, deployment_name: str) -> None:
    """Open the deployment's page, click Run -> Custom run, wait for the parameter form."""
    response = page.request.get(
        f"{ui_url}/api/deployments/name/{quote(flow_name)}/{quote(deployment_name)}",
        headers=_api_headers(page),
    )
    if not response.ok:
        raise RuntimeError(f"no deployment {flow_name}/{deployment_name}: {response.status}")
    page.goto(f"{ui_url}/deployments/deployment/{response.json()['id']}")
    page.get_by_role("button", name="Run", exact=True).click()  # exact: not the "Runs" nav
    page.get_by_text("Custom run", exact=True).click()
    page.wait_for_url(re.compile(r"/deployments/deployment/[^/]+/run"))
    # The schema form renders after the deployment loads; wait for its first field.
    page.locator(".schema-form-property__label").first.wait_for()


def set_form_value(page: Page, labels: Sequence[str], value: str | float | bool) -> None:
    """Set one field through the rendered form; ``labels`` are field titles, outermost first.

    E.g. ``["Training", "Epochs"]``. Handles number and text inputs, switches (bool) and enum
    selects. Titles are matched with or without the form's " (Optional)" suffix; when a title
    repeats (section "Model" holds field "Model"), the outermost match wins at each level.
    """
    scope: Page | Locator = page
    field: Locator | None = None
    for label in labels:
        title = re.compile(rf"^{re.escape(label)}( \(Optional\))?$")
        field = scope.get_by_text(title).first.locator(_PROPERTY)
        scope = field.locator(_PROPERTY_BODY)  # below its own label: "Model" in "Model"
    if field is None:
        raise ValueError("labels is empty")
    field.wait_for()
    if isinstance(value, bool):
        field.get_by_role("switch").set_checked(value)
        return
    text_input = field.get_by_role("spinbutton").or_(field.get_by_role("textbox"))
    if text_input.count():
        text_input.fill(str(value))
        return
    # Enum select: a mouse click does not open it, the keyboard does.
    field.locator(".p-select-button__control").press("ArrowDown")
    page.get_by_role("option", name=str(value), exact=True).click()


def submit_run(page: Page, parameters: Mapping[str, Any]) -> str:
    """Submit the form once its values hold ``parameters`` (the values set, nested as the
    flow's parameters: ``{"params": {"training": {"epochs": 1}}}``), open the new run from the
    confirmation toast, return its flow-run id.

    The form takes an input's value into its values only after a 10 ms debounce in each nested
    object (the UI's SchemaFormProperties): a Submit clicked sooner sends the values from
    before, so this waits until the form's own values hold ``parameters``.

    Raises ``RuntimeError`` with the UI's message if the server rejects the parameters.
    """
    try:
        page.wait_for_function(_FORM_HOLDS, arg=parameters)
    except PlaywrightError:
        shown = page.evaluate(_FORM_VALUES)
        raise AssertionError(f"the form's values never held {parameters}: {shown}") from None
    # The toast is rendered twice, stacked; the last copy is on top and receives the click.
    view_run = page.get_by_role("button", name="View run").last
    error = page.get_by_text("Error creating flow run").first
    answered = view_run.or_(error).first
    waited_on = answered.or_(page.get_by_text(_SERVER_ERROR_TOAST).first).first
    for _ in range(_SUBMIT_TRIES):
        page.get_by_role("button", name="Submit", exact=True).click()
        with suppress(PlaywrightError):
            waited_on.wait_for(timeout=_ANSWER_TIMEOUT_MS)
        if not answered.is_visible():  # the toast (it stays, and the UI shows no second one)
            waited_on = answered
            with suppress(PlaywrightError):  # it may have been another call's: wait a while
                answered.wait_for(timeout=_ANSWER_TIMEOUT_MS // 4)
        if answered.is_visible():
            break
        # Nothing answered the submit: a person submits again.
    else:
        raise AssertionError(f"no submit of {_SUBMIT_TRIES} created a flow run: {page.url}")
    if error.is_visible():
        message = error.inner_text()
        error.wait_for(state="hidden")  # a later submit must not read this toast again
        raise RuntimeError(message)
    # The UI returns to the deployment page, then adds "?tab=Runs"; a click before that second
    # navigation is sometimes lost to it (about 1 in 10), so wait for it. The toast lasts 5 s.
    page.wait_for_url(_DEPLOYMENT_RUNS_TAB_URL)
    view_run.click()
    page.wait_for_url(_FLOW_RUN_URL)
    match = _FLOW_RUN_URL.search(page.url)
    assert match is not None
    return match.group(1)


def wait_for_state(page: Page, state_name: str, timeout_s: float = 120) -> None:
    """Wait until the flow-run page's header shows ``state_name``, reloading between checks.

    Fails fast when the run reaches another terminal state.
    """
    badge = page.get_by_role("banner").locator(".state-badge")
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            expect(badge).to_have_text(state_name, timeout=max(1.0, min(15.0, remaining)) * 1000)
            return
        except AssertionError:
            shown = badge.inner_text() if badge.count() else "no state"
            if shown == state_name:  # shown as the last check's time ran out
                return
            if shown in _TERMINAL_STATES or time.monotonic() >= deadline:
                raise AssertionError(f"flow run shows {shown!r}, expected {state_name!r}") from None
            page.reload()
