"""One coordinator per study, claimed in the study's own database.

A campaign's storage lease (:mod:`integrations.storage`) lives under its storage root, so two
coordinators of one study with different storage roots (two hosts, each with its own
``file://`` storage) would each hold a lease of their own and both write the study. The claim
sits where the study lives: a row of ``prefect_ml_study_claims`` in the Optuna database, one per
study, naming its holder (id, host, PID, process start) with a heartbeat. Each step is one
statement that the database makes atomic:

- a free study is taken by INSERTing its row: of two processes at the same instant, the
  primary key lets exactly one in;
- a dead holder's row is taken over by ``UPDATE ... WHERE holder = :seen AND heartbeat =
  :seen``, a compare-and-swap on the row as it was judged: of two racers exactly one changes
  it, and a holder that renewed in between keeps it;
- the holder renews its heartbeat every ``expiry_s / 6`` (``UPDATE ... WHERE holder = :me``; no
  row changed means it was taken over) and deletes its row when it ends.

A row is free when its holder is dead on this host (:meth:`LeaseRecord.dead_on_this_host`), was
left by this very process, or has not renewed for the expiry (``PREFECT_ML_LEASE_EXPIRY_S``).
Heartbeats and ages are the database's clock (``clock_timestamp()``, ``julianday('now')``),
never a host's. PostgreSQL and SQLite databases have claims; a journal file (no database) and
other databases keep only the storage lease.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from functools import cache
from typing import TYPE_CHECKING, Any

from prefect_ml.integrations.campaign._studies import engine_options, is_database
from prefect_ml.integrations.errors import PrefectMLError
from prefect_ml.integrations.libraries import lazy_import
from prefect_ml.integrations.redaction import masked
from prefect_ml.integrations.settings import get_settings
from prefect_ml.integrations.storage import Heartbeat, LeaseRecord, held_error

if TYPE_CHECKING:
    import sqlalchemy as sa
else:
    sa = lazy_import("sqlalchemy")  # when a campaign claims its study, not with the flows

logger = logging.getLogger(__name__)

_ATTEMPTS = 5  # changes by others between our look and our write, before we give up
# The database's clock, in seconds since the epoch.
_CLOCKS = {
    "postgresql": "CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION)",
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
}
_RECORD_FIELDS = [f.name for f in dataclasses.fields(LeaseRecord) if f.name != "released"]


@cache
def claims_table() -> sa.Table:
    """The claims' table, one row per claimed study (made on first use, as SQLAlchemy loads)."""
    return sa.Table(
        "prefect_ml_study_claims",
        sa.MetaData(),
        sa.Column("study", sa.String(512), primary_key=True),  # Optuna's limit on study names
        sa.Column("holder", sa.String(64), nullable=False),
        sa.Column("host", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("process_space", sa.String(255), nullable=False),
        sa.Column("process_start", sa.String(32), nullable=False),
        sa.Column("what", sa.String(512), nullable=False),
        sa.Column("written_at", sa.Double, nullable=False),  # the holder's clock, for people only
        sa.Column("heartbeat", sa.Double, nullable=False),  # the database's clock
    )


def claims_supported(storage_url: str) -> bool:
    """Whether studies in this Optuna storage are claimed in its database."""
    return (
        is_database(storage_url) and sa.engine.make_url(storage_url).get_backend_name() in _CLOCKS
    )


class StudyClaim:
    """The right to coordinate one study, held in its database by one process at a time.

    Usage::

        with StudyClaim(storage_url, study_name, what="campaign 'c'", field="sweep.campaign"):
            ...  # write the study; stop when ``raise_if_lost`` raises

    Entering takes the claim (or raises :class:`~integrations.storage.LeaseHeldError`, naming
    the holder) and starts its heartbeat; leaving (also on an exception) deletes the row, so a
    Prefect retry in the same process takes it again at once.

    Args:
        storage_url: the Optuna storage, a PostgreSQL or SQLite URL (:func:`claims_supported`).
        study: the study's name.
        what: what the claim guards, as the refusal message names it.
        field: the parameter a refused user would change (``LeaseHeldError.field``).
        expiry_s: how long an unrenewed claim stays held; default ``PREFECT_ML_LEASE_EXPIRY_S``.
    """

    def __init__(
        self,
        storage_url: str,
        study: str,
        *,
        what: str,
        field: str,
        expiry_s: float | None = None,
    ) -> None:
        self.url, self.study, self.what, self.field = storage_url, study, what, field
        self.expiry_s = expiry_s if expiry_s is not None else get_settings().lease_expiry_s
        parsed = sa.engine.make_url(storage_url)
        self.database = masked(storage_url)
        clock = _CLOCKS[parsed.get_backend_name()]
        self._clock: sa.ColumnElement[float] = sa.literal_column(clock, sa.Double)
        self._record = LeaseRecord.mine(uuid.uuid4().hex, what)
        self._engine: sa.Engine | None = None
        self._claims = claims_table()
        where = f"its claim on study '{study}' ({self.database})"
        self._beats = Heartbeat(what, self._record.holder, where, self.expiry_s, self.renew)

    @property
    def lost(self) -> bool:
        """True once another process took the claim over, or it could not be renewed for two
        thirds of the expiry: the holder must stop writing."""
        return self._beats.lost

    def __enter__(self) -> StudyClaim:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> StudyClaim:
        """Take the claim, or raise ``LeaseHeldError`` if a live process holds it."""
        try:
            self._take()
        except BaseException as exc:
            self._beats.stop()
            self._disconnect()
            if isinstance(exc, sa.exc.OperationalError):  # transient: Prefect retries it
                raise PrefectMLError(
                    f"{self.what}: cannot reach the Optuna database {self.database} to claim "
                    f"study '{self.study}' ({exc.orig}); check PREFECT_ML_OPTUNA_STORAGE and "
                    "that the database accepts connections"
                ) from exc
            raise
        self._beats.start()
        return self

    def _take(self) -> None:
        """Insert our row, or take over a free one; refuse a live holder's."""
        self._beats.begin()
        for _ in range(_ATTEMPTS):
            if self._insert():
                return
            seen = self._read()
            if seen is None:
                continue  # released since our insert
            record, heartbeat, age = seen
            # Our own row is one a failed release left (we are only now taking the claim).
            dead = (
                record.holder == self._record.holder
                or record.dead_on_this_host()
                or record.left_by_this_process()
            )
            if not dead and age <= self.expiry_s:
                where = f"claim on study '{self.study}' in {self.database}"
                raise held_error(
                    self.field, self.what, record, where, "database", age, self.expiry_s
                )
            if self._take_over(record, heartbeat):
                why = "its holder is gone" if dead else f"no heartbeat for {age:.0f}s"
                logger.warning(
                    "Took over %s from process %s on %s (%s)",
                    self.what,
                    record.pid,
                    record.host,
                    why,
                )
                return
        raise PrefectMLError(
            f"{self.what}: {_ATTEMPTS} other processes claimed study '{self.study}' in "
            f"{self.database} one after another while this one tried; run the command again"
        )

    def release(self) -> None:
        """Stop renewing and delete our row (unless the claim was taken over)."""
        if not self._beats.running:
            return
        self._beats.stop()
        try:
            if not self.lost:
                with self._connect().begin() as connection:
                    connection.execute(sa.delete(self._claims).where(*self._ours()))
        except Exception as exc:  # the claim then expires on its own; keep the caller's error
            logger.warning("Could not release the claim on %s (%s); it expires", self.what, exc)
        finally:
            self._disconnect()

    def renew(self) -> bool:
        """Move our heartbeat to the database's now; whether we still hold the claim."""
        if self.lost:
            return False
        with self._connect().begin() as connection:
            changed = connection.execute(
                sa.update(self._claims)
                .where(*self._ours())
                .values(heartbeat=self._clock, written_at=time.time())
            ).rowcount
        if changed != 1:
            self._beats.lose(f"another process took over study '{self.study}'")
            return False
        return True

    def raise_if_lost(self) -> None:
        """Raise ``LeaseLostError`` if the heartbeat found the claim lost (no database call)."""
        self._beats.raise_if_lost()

    def _ours(self) -> tuple[Any, ...]:
        return self._claims.c.study == self.study, self._claims.c.holder == self._record.holder

    def _row(self) -> dict[str, Any]:
        """Our row's values, the heartbeat as the database's clock."""
        record = dataclasses.replace(self._record, written_at=time.time())
        values = {name: getattr(record, name) for name in _RECORD_FIELDS}
        return {**values, "study": self.study, "heartbeat": self._clock}

    def _insert(self) -> bool:
        """Create the study's row as ours; False if it exists (someone holds or held it)."""
        try:
            with self._connect().begin() as connection:
                connection.execute(sa.insert(self._claims).values(**self._row()))
        except sa.exc.IntegrityError:
            return False
        return True

    def _read(self) -> tuple[LeaseRecord, float, float] | None:
        """The study's row as a record, its heartbeat and its age by the database's clock."""
        with self._connect().connect() as connection:
            row = (
                connection.execute(
                    sa.select(self._claims, self._clock.label("now")).where(
                        self._claims.c.study == self.study
                    )
                )
                .mappings()
                .first()
            )
        if row is None:
            return None
        record = LeaseRecord(**{name: row[name] for name in _RECORD_FIELDS})
        return record, row["heartbeat"], row["now"] - row["heartbeat"]

    def _take_over(self, seen: LeaseRecord, heartbeat: float) -> bool:
        """Replace the row judged free with ours, if it is still as seen; whether it is ours."""
        with self._connect().begin() as connection:
            changed = connection.execute(
                sa.update(self._claims)
                .where(
                    self._claims.c.study == self.study,
                    self._claims.c.holder == seen.holder,
                    self._claims.c.heartbeat == heartbeat,
                )
                .values(**self._row())
            ).rowcount
        return bool(changed == 1)

    def _connect(self) -> sa.Engine:
        if self._engine is None:
            engine = sa.create_engine(self.url, **engine_options(self.url))
            try:
                self._claims.create(engine, checkfirst=True)
            except sa.exc.DBAPIError:  # another process created it between our check and create
                if not sa.inspect(engine).has_table(self._claims.name):
                    raise
            self._engine = engine
        return self._engine

    def _disconnect(self) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
