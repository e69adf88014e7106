"""Several versions on one endpoint: a request may select a registered version other than the
one the application serves, and each replica loads it on demand.

A request selects ``<name>/<version>`` or ``<name>@<alias>`` by Ray Serve's multiplexing header
(``serve_multiplexed_model_id``) or by its path (``/v2/models/<name>/versions/<v>/...``,
``/models/<name>/versions/<v>/...``: a number is a version, anything else an alias). The
versions of the served model and of ``serving.other_models`` may be selected, nothing else.
Ray Serve's model multiplexing (``@serve.multiplexed``) keeps at most
``serving.max_models_per_replica`` of them loaded per replica, unloads the least recently used
past that, and routes a request whose header names a version to a replica that has it loaded.

The registry is read in the replica: a version's schema once (a version's artifacts do not
change), an alias again after :data:`ALIAS_TTL_S` (so moving it reaches the replicas). A
version that does not load answers 503 for itself only, and is tried again only after
:data:`FAILURE_TTL_S`, so that its clients do not make the replica download it per request.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Generic, NamedTuple, TypeVar

from prefect_ml.integrations import tracking
from prefect_ml.integrations.serving._models import (
    NotRegistered,
    ServedModel,
    version_by_reference,
)
from prefect_ml.integrations.serving._protocol import RequestError

MODEL_ID_HEADER = "serve_multiplexed_model_id"
MAX_VERSION = 2**31 - 1  # the registry's version column; a larger number is its internal error
ALIAS_TTL_S = 10.0
FAILURE_TTL_S = 30.0

Loaded = TypeVar("Loaded")


class Selection(NamedTuple):
    """A version a request selects: a registered model's name and a version number or alias."""

    name: str
    reference: str

    @property
    def is_alias(self) -> bool:
        return not _is_number(self.reference)

    def __str__(self) -> str:
        return f"{self.name}@{self.reference}" if self.is_alias else f"{self.name}/{self.reference}"


def parse_model_id(model_id: str) -> Selection:
    """The selection a ``serve_multiplexed_model_id`` header names, or a 400 saying how to name
    one."""
    name, slash, version = model_id.rpartition("/")
    if slash and name and _is_number(version):
        return Selection(name, version)
    name, at, alias = model_id.rpartition("@")
    if at and name and alias and "/" not in alias:
        return Selection(name, alias)
    raise RequestError(
        400,
        f"{MODEL_ID_HEADER} {model_id!r} names no version; send <name>/<version> "
        "(e.g. digits-classifier/2) or <name>@<alias> (e.g. digits-classifier@challenger)",
    )


def _is_number(text: str) -> bool:
    return text.isascii() and text.isdigit()


def chosen(header: str, path: Selection | None) -> Selection | None:
    """The version a request selects by its header (``header``: "" without one) or its path;
    a 400 when both name different ones."""
    from_header = parse_model_id(header) if header else None
    if from_header is not None and path is not None and from_header != path:
        raise RequestError(
            400, f"the path selects {path} and the {MODEL_ID_HEADER} header {from_header}; send one"
        )
    return path or from_header


class VersionCatalog:
    """What a replica knows of the registry: which models may be selected, the schema of each
    version asked for (kept), and what each alias points at (looked up again after
    :data:`ALIAS_TTL_S`); and which versions failed to load lately."""

    def __init__(self, served: ServedModel, other_models: list[str]) -> None:
        self.served = served
        self.names = frozenset({served.name, *other_models})
        self._tracking_uri = tracking.worker_uri(served.tracking_uri)
        self._lock = threading.Lock()
        self._schemas: dict[str, ServedModel] = {model_id(served): served}
        self._aliases: dict[Selection, tuple[str, float]] = {}
        self._failures: dict[str, tuple[str, float]] = {}

    def check_name(self, name: str) -> None:
        """A 404 unless versions of ``name`` may be selected here."""
        if name not in self.names:
            raise RequestError(
                404, f"{name} is not served here; versions of {sorted(self.names)} are"
            )

    def cached(self, selection: Selection) -> ServedModel | None:
        """The selected version's schema if it is known without asking the registry."""
        self.check_name(selection.name)
        number = self._version_number(selection, time.monotonic())
        return None if number is None else self._schemas.get(f"{selection.name}/{number}")

    def resolve(self, selection: Selection) -> ServedModel:
        """The selected version's schema, from the registry if need be (blocking: call it in a
        thread); a 404 for a version or alias the model does not have, a 503 when the
        registry cannot be read or the version has no schema."""
        cached = self.cached(selection)
        if cached is not None:
            return cached
        name = selection.name
        if not selection.is_alias and int(selection.reference) > MAX_VERSION:
            raise RequestError(404, f"{name} has no version {selection.reference}")
        try:
            served = version_by_reference(
                self._tracking_uri, name, selection.reference, selection.is_alias
            )
        except NotRegistered:
            what = "alias" if selection.is_alias else "version"
            raise RequestError(404, f"{name} has no {what} {selection.reference}") from None
        except Exception as exc:  # the registry is down, or the version has no schema
            raise _unavailable(selection, _reason(exc)) from None
        served = self._schemas.get(model_id(served), served)  # one object per version
        with self._lock:
            if selection.is_alias:
                self._aliases[selection] = (served.version, time.monotonic())
            self._schemas[model_id(served)] = served
        return served

    def failure(self, served: ServedModel) -> None:
        """A 503 while ``served`` failed to load less than :data:`FAILURE_TTL_S` ago."""
        failed = self._failures.get(model_id(served))
        if failed is not None and time.monotonic() - failed[1] < FAILURE_TTL_S:
            raise _unavailable(Selection(served.name, served.version), failed[0])

    def record_failure(self, served: ServedModel, exc: Exception) -> RequestError:
        """Remember that ``served`` did not load; the 503 that says why."""
        reason = _reason(exc)
        with self._lock:
            self._failures[model_id(served)] = (reason, time.monotonic())
        return _unavailable(Selection(served.name, served.version), reason)

    def _version_number(self, selection: Selection, now: float) -> str | None:
        if not selection.is_alias:
            return selection.reference
        known = self._aliases.get(selection)
        return known[0] if known is not None and now - known[1] < ALIAS_TTL_S else None


def model_id(served: ServedModel) -> str:
    """How Ray's multiplexing and this module name a version: ``<name>/<version>``."""
    return str(Selection(served.name, served.version))


def _reason(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _unavailable(selection: Selection, reason: str) -> RequestError:
    return RequestError(
        503,
        f"{selection} cannot be served now ({reason}); the other versions answer",
        headers={"Retry-After": str(int(FAILURE_TTL_S))},
    )


class _Held(Generic[Loaded]):
    """A loaded version as Ray's multiplexer holds it: Ray calls ``__del__`` when it unloads
    it (in a thread), which hands ``value`` to ``retire`` on the replica's event loop."""

    def __init__(
        self, value: Loaded, retire: Callable[[Loaded], None], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.value, self._retire, self._loop = value, retire, loop
        self._retired = False

    def __del__(self) -> None:
        if self._retired:
            return
        self._retired = True
        try:
            self._loop.call_soon_threadsafe(self._retire, self.value)
        except RuntimeError:
            pass  # the loop closed: the replica is going away with everything it held


class PinnedVersions(Generic[Loaded]):
    """The selected versions a replica holds, at most ``max_models`` of them, loaded on demand
    by ``load`` (blocking: it runs in a thread) through Ray Serve's multiplexing; ``retire``
    runs on the event loop for each one unloaded."""

    def __init__(
        self,
        max_models: int,
        load: Callable[[ServedModel], Loaded],
        retire: Callable[[Loaded], None],
    ) -> None:
        from ray import serve

        self._load, self._retire = load, retire
        self._pending: dict[str, ServedModel] = {}
        self.loaded: dict[str, Loaded] = {}  # by model id, in the order they were loaded

        async def load_model(model_id: str) -> _Held[Loaded]:
            served = self._pending[model_id]
            value = await asyncio.to_thread(self._load, served)
            self.loaded[model_id] = value
            return _Held(value, self._unloaded(model_id), asyncio.get_running_loop())

        self._multiplexed = serve.multiplexed(max_num_models_per_replica=max_models)(load_model)

    def _unloaded(self, model_id: str) -> Callable[[Loaded], None]:
        def retire(value: Loaded) -> None:
            if self.loaded.get(model_id) is value:
                del self.loaded[model_id]
            self._retire(value)

        return retire

    async def get(self, served: ServedModel) -> Loaded:
        """``served`` loaded, from memory or now (unloading the least recently used one)."""
        key = model_id(served)
        self._pending[key] = served
        held: _Held[Loaded] = await self._multiplexed(key)
        return held.value
