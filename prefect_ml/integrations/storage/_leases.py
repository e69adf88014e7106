"""One writer per training run and per campaign: a lease held in the storage, renewed by a
heartbeat, taken over when its holder is dead.

A lease folder holds generations, ``gen-000001.json``, ``gen-000002.json``, ... Taking the lease
is creating the next generation exclusively (:func:`storage.create_exclusive`), so of two
processes racing for it exactly one wins. The holder renews by rewriting its own generation and
stops holding when a later one appears (it was presumed dead and taken over). Only the newest
generation counts; it is free when it is released, or when its holder is dead:

- on this host (same host name, boot and PID namespace): its process is gone, or its PID now
  belongs to another process (a different start time), so a rerun after SIGKILL starts at once;
- anywhere: it has not been renewed for the expiry (``PREFECT_ML_LEASE_EXPIRY_S``), measured
  as the storage's clock now minus the time the storage wrote the record. Another host's clock
  is never compared with ours.

A campaign whose study is in a database also claims it there
(:class:`~integrations.campaign.StudyClaim`), with the same records, liveness rules and
:class:`Heartbeat`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from pathlib import Path

from prefect_ml.integrations.errors import ConfigurationError, PrefectMLError
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.storage import _files, _keys

logger = logging.getLogger(__name__)

_GENERATION = re.compile(r"^gen-(\d{6,})\.json$")
_ATTEMPTS = 5  # generations created by others between our look and our create, before we give up
# The leases this call chain holds (a flow holds its run's lease across train, evaluate and
# register; the train step inside joins it). A context variable, not a process-wide set: another
# thread or process with the same URL is another driver and is refused.
_HELD: ContextVar[tuple[Lease, ...]] = ContextVar("prefect_ml_held_leases", default=())
# Holder ids of the leases this process holds now. A record of this very process whose holder
# is not here was left by a hold whose release could not be written (a storage outage): free.
_HOLDING: set[str] = set()


class LeaseHeldError(ConfigurationError):
    """Another live process holds the lease; the message names it and says what to do."""


class LeaseLostError(PrefectMLError):
    """Another process took the lease over while we held it (we were presumed dead)."""


def _process_space() -> str:
    """Where a PID means the same process as here: this boot of this kernel, this PID namespace."""
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(path) if path.endswith("/pid") else Path(path).read_text())
        except OSError:
            parts.append("?")
    return "/".join(part.strip() for part in parts)


def _process_start(pid: int) -> str:
    """The start time of process ``pid`` in clock ticks since boot ("" where unknown): a PID
    reused by another process (after a container restart) has another start time."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return stat.rsplit(")", 1)[1].split()[19]  # field 22; the command name may hold spaces


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class LeaseRecord:
    """One generation's content. ``written_at`` is the writer's own clock, for people only:
    liveness uses the time the storage wrote the record."""

    holder: str
    host: str
    pid: int
    process_space: str
    process_start: str
    what: str
    written_at: float
    released: bool = False

    @classmethod
    def mine(cls, holder: str, what: str) -> LeaseRecord:
        return cls(
            holder=holder,
            host=socket.gethostname(),
            pid=os.getpid(),
            process_space=_process_space(),
            process_start=_process_start(os.getpid()),
            what=what,
            written_at=time.time(),
        )

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes | bytearray) -> LeaseRecord:
        return cls(**json.loads(data))

    def left_by_this_process(self) -> bool:
        """Written by this very process for a hold it has since ended (its release failed)."""
        mine = LeaseRecord.mine(self.holder, self.what)
        same_process = (self.host, self.process_space, self.pid, self.process_start) == (
            mine.host,
            mine.process_space,
            mine.pid,
            mine.process_start,
        )
        return same_process and self.holder not in _HOLDING

    def dead_on_this_host(self) -> bool:
        """Whether the holder ran here and its process is gone (or its PID is another's now)."""
        if self.host != socket.gethostname() or self.process_space != _process_space():
            return False
        if not _pid_alive(self.pid):
            return True
        start = _process_start(self.pid)
        return bool(start and self.process_start and start != self.process_start)


class Heartbeat:
    """A hold's renewals: ``renew`` every ``expiry_s / 6`` on a daemon thread until stopped.

    ``renew`` returns False once the hold was taken over; renewals that keep failing for two
    thirds of the expiry mark it lost as well, well before others may take it over (at the
    expiry), so two writers never overlap, even for one heartbeat. While it runs, this process
    holds ``holder`` (:meth:`LeaseRecord.left_by_this_process`).

    Args:
        what: what the hold guards, as messages name it.
        holder: the hold's holder id (its records' ``holder``).
        where: where the hold lives, for the error of a lost one ("its lease (<url>)").
        expiry_s: how long an unrenewed hold stays held.
        renew: one renewal; whether we still hold it.
    """

    def __init__(
        self, what: str, holder: str, where: str, expiry_s: float, renew: Callable[[], bool]
    ) -> None:
        self.what, self.holder, self.where, self.expiry_s = what, holder, where, expiry_s
        self._renew = renew
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._renewed_at = 0.0  # time.monotonic() of the last successful renewal

    @property
    def running(self) -> bool:
        return self._thread is not None

    @property
    def lost(self) -> bool:
        return self._lost.is_set()

    def begin(self) -> None:
        """Count as holding from just before the write that takes the hold, so that another
        thread here that reads our new record never takes it for one left behind."""
        _HOLDING.add(self.holder)

    def start(self) -> None:
        """Start renewing a hold taken just now."""
        self.begin()
        self._renewed_at = time.monotonic()
        self._lost.clear()
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name=f"lease {self.what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing (the caller then releases the hold, unless it was lost), or give up
        taking it."""
        _HOLDING.discard(self.holder)
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def lose(self, why: str) -> None:
        self._lost.set()
        logger.error("Lost the lease on %s: %s; stop writing", self.what, why)

    def raise_if_lost(self) -> None:
        """Raise :class:`LeaseLostError` if the hold was lost."""
        if self.lost:
            raise LeaseLostError(
                f"{self.what}: another process took over {self.where} because this one had "
                f"not renewed it for {self.expiry_s:.0f}s and was presumed dead; this process "
                "stopped writing. The other process carries on; check its progress before "
                "running this command again."
            )

    def _beat(self) -> None:
        while not self._stop.wait(self.expiry_s / 6):
            try:
                if not self._renew():
                    return
                self._renewed_at = time.monotonic()
            except Exception as exc:
                silent = time.monotonic() - self._renewed_at
                logger.warning("Could not renew the lease on %s: %s", self.what, exc)
                if silent > self.expiry_s * 2 / 3:
                    self.lose(f"not renewed for {silent:.0f}s; it may be taken over")
                    return


def held_error(
    field: str, what: str, record: LeaseRecord, where: str, clock: str, age: float, expiry_s: float
) -> LeaseHeldError:
    """The refusal of a hold (``where``: "lease <url>, generation 3") that ``record``'s live
    holder renewed ``age`` seconds ago by ``clock``'s clock ("storage", "database")."""
    return LeaseHeldError(
        field,
        f"{what} is being written by process {record.pid} on {record.host} ({where}; last "
        f"heartbeat {age:.0f}s ago by the {clock}'s clock, held for {expiry_s - age:.0f}s more "
        "unless renewed). Wait for it to finish, or stop that process; a process that died is "
        f"taken over at once on its own host, or {expiry_s:.0f}s after its last heartbeat from "
        "elsewhere.",
    )


class Lease:
    """The right to write one run or campaign, held by one process at a time.

    Usage::

        with Lease(url, what="training run 1a2b", field="experiment") as lease:
            ...  # write; stop when ``lease.lost`` turns true

    Entering takes the lease (or raises :class:`LeaseHeldError`) and starts a heartbeat thread
    that renews it every ``expiry_s / 6``; leaving (also on an exception) releases it, so a
    Prefect retry in the same process takes it again at once.

    Args:
        url: the lease folder (``file://`` or ``s3://``), e.g. :func:`storage.lease_url`.
        what: what the lease guards, as the refusal message names it.
        field: the parameter a refused user would change (``LeaseHeldError.field``).
        expiry_s: how long an unrenewed lease stays held; default ``PREFECT_ML_LEASE_EXPIRY_S``.
        join: if this call chain already holds the lease at ``url`` (an outer ``with`` of the
            same folder), share it instead of being refused; entering and leaving then change
            nothing in the storage.
    """

    def __init__(
        self,
        url: str,
        *,
        what: str,
        field: str,
        expiry_s: float | None = None,
        join: bool = False,
    ) -> None:
        self.url = url.rstrip("/")
        self.what, self.field, self.join = what, field, join
        self._outer: Lease | None = None  # the lease of this call chain we joined
        self.expiry_s = expiry_s if expiry_s is not None else get_settings().lease_expiry_s
        self.generation = 0  # ours, once held
        self._record = LeaseRecord.mine(uuid.uuid4().hex, what)
        self._beats = Heartbeat(
            what, self._record.holder, f"its lease ({self.url})", self.expiry_s, self.renew
        )

    @property
    def lost(self) -> bool:
        """True once another process took the lease over, or we could not renew it for the
        expiry (others may have presumed us dead): the holder must stop writing."""
        if self._outer is not None:
            return self._outer.lost
        return self._beats.lost

    @property
    def superseded_url(self) -> str:
        """The URL whose existence means our lease was taken over (the next generation), for
        processes that must stop with us but cannot see this object, such as training workers."""
        return self._generation_url(self.generation + 1)

    def _generation_url(self, generation: int) -> str:
        return _keys.join(self.url, f"gen-{generation:06d}.json")

    def __enter__(self) -> Lease:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> Lease:
        """Take the lease, or raise :class:`LeaseHeldError` if a live process holds it."""
        held = _HELD.get()
        if self.join and (outer := next((h for h in held if h.url == self.url), None)):
            outer.ensure_held()  # a lost hold stays lost: its retry must not write again
            self._outer, self.generation = outer, outer.generation
            return self
        try:
            self.generation = self._take()
        except BaseException:
            self._beats.stop()
            raise
        self._beats.start()
        _HELD.set((*held, self))
        return self

    def _take(self) -> int:
        """Create the generation after a free newest one; ours."""
        for _ in range(_ATTEMPTS):
            generation, record = self._newest()
            if record is not None and (age := self._held_for(generation, record)) is not None:
                raise self._held_error(generation, record, age)
            self._beats.begin()
            if self._claim(generation + 1):
                return generation + 1
        raise PrefectMLError(
            f"{self.what}: {_ATTEMPTS} other processes took the lease ({self.url}) one after "
            "another while this one tried; run the command again"
        )

    def release(self) -> None:
        """Stop renewing and mark our generation released (unless it was taken over)."""
        if self._outer is not None:
            self._outer = None
            return
        if not self._beats.running:
            return
        _HELD.set(tuple(h for h in _HELD.get() if h is not self))
        self._beats.stop()
        if self.lost:
            return
        try:
            released = LeaseRecord(**{**asdict(self._record), "released": True})
            _files.write_bytes(self._generation_url(self.generation), released.to_bytes())
        except Exception as exc:  # the lease then expires on its own; keep the caller's error
            logger.warning("Could not release the lease on %s (%s); it expires", self.what, exc)

    def renew(self) -> bool:
        """Rewrite our generation (the heartbeat), then check that no later one exists;
        whether we still hold the lease."""
        if self.lost:
            return False
        self._record = LeaseRecord(**{**asdict(self._record), "written_at": time.time()})
        _files.write_bytes(self._generation_url(self.generation), self._record.to_bytes())
        if _files.exists(self.superseded_url):
            self._beats.lose(f"another process took it over ({self.superseded_url})")
            return False
        return True

    def ensure_held(self) -> None:
        """Raise :class:`LeaseLostError` if the lease was lost, asking the storage now rather
        than waiting for the next heartbeat (before a step that must not be done twice)."""
        if self._outer is not None:
            self._outer.ensure_held()
            return
        if not self.lost and _files.exists(self.superseded_url):
            self._beats.lose(f"another process took it over ({self.superseded_url})")
        self.raise_if_lost()

    def raise_if_lost(self) -> None:
        """Raise :class:`LeaseLostError` if the heartbeat found the lease lost; no storage call,
        so a loop may ask every iteration without a storage hiccup stopping it."""
        if self._outer is not None:
            self._outer.raise_if_lost()
            return
        self._beats.raise_if_lost()

    def _claim(self, generation: int) -> bool:
        """Create ``generation`` exclusively; whether it is ours."""
        url = self._generation_url(generation)
        if _files.create_exclusive(url, self._record.to_bytes()):
            return True
        # A create whose reply was lost and was retried finds its own record.
        return self._read(generation) == self._record

    def _read(self, generation: int) -> LeaseRecord | None:
        try:
            return LeaseRecord.from_bytes(_files.read_bytes(self._generation_url(generation)))
        except FileNotFoundError:
            return None

    def _newest(self) -> tuple[int, LeaseRecord | None]:
        """The newest generation and its record (0 and None for an empty folder)."""
        names = (_GENERATION.match(name) for name in _files.list_names(self.url))
        newest = max((int(m.group(1)) for m in names if m), default=0)
        return newest, self._read(newest) if newest else None

    def _held_for(self, generation: int, record: LeaseRecord) -> float | None:
        """How long ago (by the storage's clock) a live holder last renewed ``generation``;
        None when it is free: released, its holder dead on this host, or expired."""
        if record.released or record.dead_on_this_host() or record.left_by_this_process():
            return None
        written = _files.modified_time(self._generation_url(generation))
        age = _files.storage_clock(self.url) - written
        return age if age <= self.expiry_s else None

    def _held_error(self, generation: int, record: LeaseRecord, age: float) -> LeaseHeldError:
        where = f"lease {self.url}, generation {generation}"
        return held_error(self.field, self.what, record, where, "storage", age, self.expiry_s)
