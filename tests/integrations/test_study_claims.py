"""The study claim contract, in SQLite and in PostgreSQL: one coordinator per study whatever its
storage root, atomic in the database (racers forced to look before either writes), refusals
that name the holder, takeover of a dead holder at once and of a silent one after the expiry
by the database's clock."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from prefect_ml.integrations.campaign import StudyClaim, claims_supported, claims_table
from prefect_ml.integrations.errors import ConfigurationError, PrefectMLError
from prefect_ml.integrations.storage import LeaseHeldError, LeaseLostError, LeaseRecord
from prefect_ml.integrations.storage._leases import _process_start
from tests.conftest import REPO_ROOT
from tests.helpers import free_port, wait_for

STUDY = "campaign-a"
WHAT = "campaign 'campaign-a'"


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An Optuna storage URL: a new SQLite file, or a new database on the session's PostgreSQL."""
    if request.param == "postgresql":
        return str(request.getfixturevalue("postgres_database"))
    return f"sqlite:///{tmp_path}/optuna.db"


def _claim(url: str, expiry_s: float = 60.0) -> StudyClaim:
    return StudyClaim(url, STUDY, what=WHAT, field="sweep.campaign", expiry_s=expiry_s)


def _rival(url: str, **record: Any) -> StudyClaim:
    """A claim as another process would hold it (``record``: its host, pid...). Its expiry is
    an hour, so it does not renew during a test: its heartbeat ages only as the test says."""
    claim = _claim(url, expiry_s=3600)
    claim._record = dataclasses.replace(claim._record, **record)
    return claim


def _age(url: str, seconds: float) -> None:
    """Move the claim's heartbeat ``seconds`` into the database clock's past."""
    engine, claims = sa.create_engine(url), claims_table()
    with engine.begin() as connection:
        connection.execute(sa.update(claims).values(heartbeat=claims.c.heartbeat - seconds))
    engine.dispose()


def _rows(url: str) -> list[dict[str, Any]]:
    engine = sa.create_engine(url)
    with engine.connect() as connection:
        rows = [dict(row) for row in connection.execute(sa.select(claims_table())).mappings()]
    engine.dispose()
    return rows


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is not a coordinator: its PID exists, its start time is its own."""
    process = subprocess.Popen(["sleep", "600"])
    yield process
    process.kill()
    process.wait()


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_only_database_storages_are_claimed() -> None:
    assert claims_supported("postgresql://u:p@db:5432/optuna")
    assert claims_supported("postgresql+psycopg://db/optuna")
    assert claims_supported("sqlite:////tmp/optuna.db")
    assert not claims_supported("/var/lib/optuna.journal"), "a journal file: lease only"
    assert not claims_supported("mysql://db/optuna"), "no database clock for it here"


def test_an_unreachable_database_is_a_retried_error_without_its_password() -> None:
    from prefect_ml.tasks.retries import is_permanent

    url = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/nowhere"  # nothing listens
    with pytest.raises(PrefectMLError, match="cannot reach the Optuna database") as failed:
        _claim(url).acquire()
    assert "secret" not in str(failed.value) and "postgres:***@" in str(failed.value)
    assert not is_permanent(failed.value), "a database outage is retried"


def test_a_second_claim_is_refused_naming_the_holder_and_the_database(database: str) -> None:
    with _claim(database) as first:
        with pytest.raises(LeaseHeldError) as refused:
            _claim(database).acquire()
        assert not first.lost
        assert [row["holder"] for row in _rows(database)] == [first._record.holder]
    error = refused.value
    assert isinstance(error, ConfigurationError) and error.field == "sweep.campaign"
    message = str(error)
    assert f"{WHAT} is being written by process {os.getpid()} on " in message
    assert f"claim on study '{STUDY}' in " in message and "last heartbeat 0s ago" in message
    assert "by the database's clock" in message and "stop that process" in message
    assert _rows(database) == [], "leaving released the claim"


def test_a_released_claim_is_taken_again_at_once_and_another_study_is_free(database: str) -> None:
    claim = _claim(database)
    with claim:
        with StudyClaim(database, "campaign-b", what="campaign 'campaign-b'", field="x"):
            assert len(_rows(database)) == 2
    with claim:  # a Prefect retry in the same process re-enters the same way
        pass
    with _claim(database):
        pass


class _Racer(StudyClaim):
    """A claim that waits at ``barrier`` just before its first write of kind ``pause_before``
    (``_insert`` or ``_take_over``): every racer has looked at the row before any writes."""

    def __init__(self, url: str, barrier: threading.Barrier, pause_before: str) -> None:
        super().__init__(url, STUDY, what=WHAT, field="sweep.campaign", expiry_s=60)
        self.barrier, self.pause_before, self.paused = barrier, pause_before, False

    def _pause(self, step: str) -> None:
        if step == self.pause_before and not self.paused:
            self.paused = True
            self.barrier.wait(timeout=60)

    def _insert(self) -> bool:
        self._pause("_insert")
        return super()._insert()

    def _take_over(self, seen: LeaseRecord, heartbeat: float) -> bool:
        self._pause("_take_over")
        return super()._take_over(seen, heartbeat)


def _race(racers: list[_Racer]) -> tuple[list[_Racer], list[BaseException]]:
    """Run every racer's ``acquire`` on its own thread; the winners and the errors."""
    outcomes: dict[int, BaseException | None] = {}

    def attempt(index: int) -> None:
        try:
            racers[index].acquire()
            outcomes[index] = None
        except BaseException as exc:
            outcomes[index] = exc

    threads = [threading.Thread(target=attempt, args=(i,)) for i in range(len(racers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    winners = [racers[i] for i, error in outcomes.items() if error is None]
    return winners, [error for error in outcomes.values() if error is not None]


def _release_all(claims: list[_Racer]) -> None:
    for claim in claims:
        claim.release()


@pytest.mark.parametrize(
    "holder", ["none", "silent"], ids=["free-study", "silent-holder-taken-over"]
)
def test_two_coordinators_at_the_same_instant_exactly_one_claims(
    database: str, holder: str, sleeper: subprocess.Popen[bytes]
) -> None:
    """Two coordinators of one study with different storage roots (the claim knows nothing of
    storage) released at once. On a free study both INSERT at once; on a silent holder's row
    both judged it expired before either writes, and a read-then-write takeover would let both
    win: the compare-and-swap lets exactly one."""
    rival = None
    if holder == "silent":
        rival = _rival(database, host="elsewhere", pid=sleeper.pid).acquire()
        _age(database, 120)
    barrier = threading.Barrier(2)
    pause_before = "_insert" if holder == "none" else "_take_over"
    racers = [_Racer(database, barrier, pause_before) for _ in range(2)]
    try:
        winners, errors = _race(racers)
        assert all(racer.paused for racer in racers), "both reached the write together"
        assert len(winners) == 1 and len(errors) == 1, errors
        assert isinstance(errors[0], LeaseHeldError), errors[0]
        assert [row["holder"] for row in _rows(database)] == [winners[0]._record.holder]
    finally:
        _release_all(racers)
        if rival is not None:
            rival.release()


class _PausedAfterInsert(StudyClaim):
    """A claim that, once its INSERT is in, lets ``meanwhile`` run before it goes on."""

    def __init__(self, url: str, meanwhile: Callable[[], object]) -> None:
        super().__init__(url, STUDY, what=WHAT, field="sweep.campaign", expiry_s=60)
        self.meanwhile = meanwhile

    def _insert(self) -> bool:
        inserted = super()._insert()
        if inserted:
            self.meanwhile()
        return inserted


def test_a_claim_another_thread_just_took_is_not_mistaken_for_one_left_behind(
    database: str,
) -> None:
    """Two runs of one campaign in one process (``prefect-ml deploy`` serves flow runs on
    threads): the second reads the first's row between its INSERT and the start of its
    heartbeat. Same host, PID and start time as ours: it must still count as held."""
    refusals: list[LeaseHeldError] = []

    def second_run() -> None:
        with pytest.raises(LeaseHeldError) as refused:
            _claim(database).acquire()
        refusals.append(refused.value)

    with _PausedAfterInsert(database, second_run) as first:
        assert len(refusals) == 1 and f"process {os.getpid()} " in str(refusals[0])
        assert [row["holder"] for row in _rows(database)] == [first._record.holder]


def test_a_silent_holder_with_a_live_unrelated_pid_is_taken_over_after_the_expiry(
    database: str, sleeper: subprocess.Popen[bytes]
) -> None:
    """A PID that exists is not enough: the holder stopped renewing (its record names a
    process alive on this host with its own start time). Fresh, it is refused; silent for
    longer than the expiry by the database's clock, it is taken over."""
    rival = _rival(database, pid=sleeper.pid, process_start=_process_start(sleeper.pid))
    rival.acquire()
    try:
        with pytest.raises(LeaseHeldError, match=f"process {sleeper.pid} "):
            _claim(database, expiry_s=30).acquire()
        _age(database, 31)
        with _claim(database, expiry_s=30) as claim:
            assert [row["holder"] for row in _rows(database)] == [claim._record.holder]
            assert [row["pid"] for row in _rows(database)] == [os.getpid()]
    finally:
        rival.release()


def test_another_hosts_holder_is_judged_by_the_database_clock_only(database: str) -> None:
    """Its own clock (``written_at``, a year off) does not matter: only the heartbeat the
    database wrote, against the database's now."""
    rival = _rival(database, host="elsewhere", pid=1, written_at=0.0).acquire()
    try:
        with pytest.raises(LeaseHeldError, match="process 1 on elsewhere"):
            _claim(database, expiry_s=30).acquire()
        _age(database, 31)
        with _claim(database, expiry_s=30):
            pass
    finally:
        rival.release()


@pytest.mark.parametrize("record", ["dead-pid", "reused-pid"])
def test_a_holder_dead_on_this_host_is_taken_over_at_once(database: str, record: str) -> None:
    """Its heartbeat is fresh, but its process is gone, or its PID now belongs to another
    process (ours, started at another time: a restarted container)."""
    dead = {"pid": _dead_pid()} if record == "dead-pid" else {"process_start": "12345"}
    rival = _rival(database, **dead).acquire()
    try:
        with _claim(database) as claim:
            assert [row["holder"] for row in _rows(database)] == [claim._record.holder]
    finally:
        rival.release()


def _hold_heartbeat(claim: StudyClaim) -> threading.Event:
    """Stop ``claim``'s heartbeat thread inside its next renewal until the event returned is set,
    so that no renewal lands between a test's ageing of the row and a takeover (on a loaded
    machine one did: the taker then met a heartbeat 0 s old)."""
    entered, release = threading.Event(), threading.Event()
    renew = claim._beats._renew

    def held_renew() -> bool:
        entered.set()
        release.wait(60)
        return renew()

    claim._beats._renew = held_renew
    wait_for(entered.is_set, 30, "the heartbeat thread to reach its next renewal")
    return release


def test_a_claim_taken_over_is_noticed_and_stops_the_holder(database: str) -> None:
    claim = _claim(database, expiry_s=1.2).acquire()
    taken = _hold_heartbeat(claim)
    try:
        assert claim.renew()
        _age(database, 10)
        taker = _claim(database, expiry_s=1.2).acquire()  # presumed the first one dead
        taken.set()  # the holder's next heartbeat finds the claim taken
        wait_for(lambda: claim.lost, 30, "the heartbeat to notice the takeover")
        assert not claim.renew()
        with pytest.raises(LeaseLostError, match=f"its claim on study '{STUDY}'"):
            claim.raise_if_lost()
        claim.release()
        assert [row["holder"] for row in _rows(database)] == [taker._record.holder], (
            "a lost claim deletes nothing"
        )
        taker.release()
    finally:
        claim.release()


_HOLD_A_CLAIM = """
import sys
from prefect_ml.integrations.storage import LeaseHeldError
from prefect_ml.integrations.campaign import StudyClaim, claims_supported, claims_table

claim = StudyClaim(sys.argv[1], "campaign-a", what="campaign 'campaign-a'", field="sweep.campaign")
print("ready", flush=True)
sys.stdin.readline()  # the start signal, sent to both processes at once
try:
    claim.acquire()
except LeaseHeldError as refused:
    print("refused", refused, flush=True)
    sys.exit(3)
print("claimed", flush=True)
sys.stdin.readline()  # hold it until told to stop
claim.release()
"""


def test_two_coordinator_processes_started_at_once_exactly_one_claims(
    postgres_database: str,
) -> None:
    """Whatever the interleaving of two processes on one PostgreSQL, one holds the study and
    the other is refused, naming the first."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _HOLD_A_CLAIM, postgres_database],
            cwd=REPO_ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        readline: list[Callable[[], str]] = [p.stdout.readline for p in processes]  # type: ignore[union-attr]
        assert [read().strip() for read in readline] == ["ready", "ready"]
        for process in processes:
            process.stdin.write("\n")  # type: ignore[union-attr]
        for process in processes:
            process.stdin.flush()  # type: ignore[union-attr]
        outcomes = {process.pid: read() for process, read in zip(processes, readline, strict=True)}
        claimed = [pid for pid, line in outcomes.items() if line.startswith("claimed")]
        refused = [line for line in outcomes.values() if line.startswith("refused")]
        assert len(claimed) == 1 and len(refused) == 1, outcomes
        assert f"is being written by process {claimed[0]} on " in refused[0]
        assert [row["pid"] for row in _rows(postgres_database)] == claimed
    finally:
        for process in processes:
            if process.poll() is None:
                process.communicate("\n", timeout=60)
    assert sorted(process.returncode for process in processes) == [0, 3]
    assert _rows(postgres_database) == []
