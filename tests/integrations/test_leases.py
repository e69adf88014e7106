"""The lease contract, on local disk and on the S3 server: one holder, refusals that name it,
takeover of a dead holder (at once on this host, after expiry by the storage's clock elsewhere)."""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prefect import flow, task

from prefect_ml.integrations import storage
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.storage import (
    Lease,
    LeaseHeldError,
    LeaseLostError,
    LeaseRecord,
    _files,
)
from prefect_ml.integrations.storage._leases import _process_start
from tests.helpers import wait_for


@pytest.fixture(params=["local", "s3"])
def lease_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A lease folder on local disk and on the S3 server."""
    if request.param == "s3":
        return storage.lease_url(storage.join(request.getfixturevalue("s3_bucket"), "run"))
    return storage.lease_url((tmp_path / "run").as_uri())


def _lease(url: str, expiry_s: float = 60.0) -> Lease:
    return Lease(url, what="training run abc", field="experiment", expiry_s=expiry_s)


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def _write_record(url: str, generation: int, **changes: object) -> LeaseRecord:
    """A record as another process would have written it (ours, with ``changes``)."""
    record = dataclasses.replace(LeaseRecord.mine("someone-else", "training run abc"), **changes)
    record_url = storage.join(url, f"gen-{generation:06d}.json")
    assert storage.create_exclusive(record_url, record.to_bytes())
    return record


def _wait_older_than(url: str, generation: int, seconds: float) -> None:
    """Until the storage's clock says ``generation`` was written more than ``seconds`` ago."""
    record_url = storage.join(url, f"gen-{generation:06d}.json")
    wait_for(
        lambda: storage.storage_clock(url) - storage.modified_time(record_url) > seconds,
        30,
        f"generation {generation} to age {seconds}s by the storage's clock",
    )


def test_second_holder_is_refused_naming_host_pid_and_age(lease_url: str) -> None:
    with _lease(lease_url) as first:
        with pytest.raises(LeaseHeldError) as refused:
            _lease(lease_url).acquire()
        assert not first.lost
    message = str(refused.value)
    assert isinstance(refused.value, ConfigurationError) and refused.value.field == "experiment"
    assert f"process {os.getpid()} on {socket.gethostname()}" in message
    assert "training run abc" in message and "stop that process" in message
    # The age is the storage's: a second or two on a loaded machine's S3 server.
    ages = re.search(r"last heartbeat (\d+)s ago .* held for (\d+)s more", message)
    assert ages is not None, message
    age, left = int(ages[1]), int(ages[2])
    assert age <= 5 and age + left == 60, message


def test_a_joining_lease_shares_its_call_chains_hold_and_another_thread_is_refused(
    lease_url: str,
) -> None:
    """A flow holds its run's lease across steps; the train step inside joins it, while the
    same lease wanted from another thread (another driver in this process) is refused."""
    from concurrent.futures import ThreadPoolExecutor

    with _lease(lease_url) as chain:
        inner = Lease(lease_url, what="training run abc", field="experiment", join=True)
        with inner:
            assert inner.generation == chain.generation == 1
            assert inner.superseded_url == chain.superseded_url
        assert not chain.lost  # leaving the inner hold released nothing
        with ThreadPoolExecutor(1) as other_thread:
            joined = Lease(lease_url, what="training run abc", field="experiment", join=True)
            with pytest.raises(LeaseHeldError):
                other_thread.submit(joined.acquire).result()
    with _lease(lease_url) as after:  # the outer hold released it
        assert after.generation == 2


def test_released_lease_is_taken_again_at_once(lease_url: str) -> None:
    lease = _lease(lease_url)
    with lease:
        pass
    with lease:  # a Prefect retry in the same process re-enters the same way
        assert lease.generation == 2
    with _lease(lease_url) as other:
        assert other.generation == 3


def test_prefect_retry_of_a_failed_task_takes_the_lease_again(lease_url: str) -> None:
    attempts: list[int] = []

    @task(retries=1, retry_delay_seconds=0)
    def write_once() -> int:
        with _lease(lease_url) as lease:
            attempts.append(lease.generation)
            if len(attempts) == 1:
                raise OSError("transient")
            return lease.generation

    @flow
    def writer() -> int:
        return write_once()

    assert writer() == 2
    assert attempts == [1, 2]


def test_dead_process_on_this_host_is_taken_over_at_once(lease_url: str) -> None:
    _write_record(lease_url, 1, pid=_dead_pid())
    with _lease(lease_url) as lease:
        assert lease.generation == 2


def test_reused_pid_with_another_start_time_is_taken_over(lease_url: str) -> None:
    """Our own (live) PID, started at another time: a container restart reused the PID."""
    _write_record(lease_url, 1, process_start="12345")
    with _lease(lease_url) as lease:
        assert lease.generation == 2


def test_live_process_on_this_host_with_a_stale_heartbeat_is_taken_over(lease_url: str) -> None:
    """An existing PID is not enough: a holder that stopped renewing (a stopped process)
    expires like any other."""
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    # 5 s, not 1: on a loaded machine the S3 calls between writing the record and asking for
    # the lease took over a second, the record had expired, and the lease taken then (never
    # released) failed every S3 test after it.
    early = _lease(lease_url, expiry_s=5)
    try:
        _write_record(lease_url, 1, pid=holder.pid, process_start=_process_start(holder.pid))
        with pytest.raises(LeaseHeldError, match=f"process {holder.pid} "):
            early.acquire()
        _wait_older_than(lease_url, 1, 5)
        with _lease(lease_url, expiry_s=5) as lease:
            assert lease.generation == 2
    finally:
        early.release()  # held only if the refusal failed: never left renewing
        holder.kill()
        holder.wait()


def test_a_hold_whose_release_failed_is_taken_again_by_its_own_process(
    lease_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A storage outage failed the step and the write of its release: the same process's
    Prefect retry takes the lease again at once instead of being refused by its own record."""
    first = _lease(lease_url).acquire()
    with monkeypatch.context() as outage:
        outage.setattr(_files, "write_bytes", _refuse)  # what the lease writes through
        first.release()  # logs a warning; the record still says held
    record = storage.join(lease_url, "gen-000001.json")
    assert not LeaseRecord.from_bytes(storage.read_bytes(record)).released
    with _lease(lease_url) as retry:
        assert retry.generation == 2


def _refuse(*_args: object) -> None:
    raise OSError("503 Service Unavailable")


def test_a_lost_hold_cannot_be_joined(lease_url: str) -> None:
    """A retry of the train step inside a flow whose lease was taken over must not write."""
    with _lease(lease_url, expiry_s=1.2) as chain:
        _write_record(lease_url, chain.generation + 1, host="elsewhere")
        inner = Lease(lease_url, what="training run abc", field="experiment", join=True)
        with pytest.raises(LeaseLostError):
            inner.acquire()


@pytest.mark.parametrize("skew_s", [-10 * 365 * 86400, 10 * 365 * 86400], ids=["past", "future"])
def test_another_hosts_record_is_judged_by_the_storage_clock(lease_url: str, skew_s: int) -> None:
    """The other host's own clock (``written_at``, years off) does not matter: a record the
    storage wrote just now is held, one it wrote longer ago than the expiry is free."""
    _write_record(lease_url, 1, host="elsewhere", pid=1, written_at=time.time() + skew_s)
    with pytest.raises(LeaseHeldError, match="process 1 on elsewhere"):
        _lease(lease_url, expiry_s=1).acquire()
    _wait_older_than(lease_url, 1, 1)
    with _lease(lease_url, expiry_s=1) as lease:
        assert lease.generation == 2


class _PausedBeforeClaim(Lease):
    """A lease that lets ``rival`` take the lease between judging it free and claiming it."""

    def __init__(self, url: str, rival: Lease) -> None:
        super().__init__(url, what="training run abc", field="experiment")
        self.rival = rival

    def _claim(self, generation: int) -> bool:
        if not self.rival.generation:
            self.rival.acquire()
        return super()._claim(generation)


def test_two_racers_for_a_dead_lease_exactly_one_wins(lease_url: str) -> None:
    _write_record(lease_url, 1, pid=_dead_pid())
    winner = _lease(lease_url)
    loser = _PausedBeforeClaim(lease_url, winner)
    try:
        with pytest.raises(LeaseHeldError, match=f"process {os.getpid()} "):
            loser.acquire()  # judged generation 1 dead, but the winner created generation 2
        assert winner.generation == 2 and not winner.lost
        assert storage.list_names(lease_url) == ["gen-000001.json", "gen-000002.json"]
    finally:
        winner.release()


class _PausedAfterClaim(Lease):
    """A lease that, once its generation is created, lets ``meanwhile`` run before it goes on."""

    def __init__(self, url: str, meanwhile: Callable[[], object]) -> None:
        super().__init__(url, what="training run abc", field="experiment")
        self.meanwhile = meanwhile

    def _claim(self, generation: int) -> bool:
        claimed = super()._claim(generation)
        if claimed:
            self.meanwhile()
        return claimed


def test_a_lease_another_thread_just_took_is_not_mistaken_for_one_left_behind(
    lease_url: str,
) -> None:
    """Another thread of this process reads our new generation before our heartbeat starts:
    written by this very process, it must still count as held, not as a failed release's."""
    refusals: list[LeaseHeldError] = []

    def other_thread() -> None:
        with pytest.raises(LeaseHeldError) as refused:
            _lease(lease_url).acquire()
        refusals.append(refused.value)

    with _PausedAfterClaim(lease_url, other_thread) as first:
        assert len(refusals) == 1 and first.generation == 1
    assert storage.list_names(lease_url) == ["gen-000001.json"]


def test_a_lost_lease_is_noticed(lease_url: str) -> None:
    with _lease(lease_url, expiry_s=1.2) as lease:
        assert lease.renew()
        assert not storage.exists(lease.superseded_url)
        _write_record(lease_url, lease.generation + 1, host="elsewhere")  # presumed us dead
        wait_for(lambda: lease.lost, 30, "the heartbeat to notice the takeover")
        assert not lease.renew()
        with pytest.raises(LeaseLostError, match="another process took over"):
            lease.ensure_held()
    newest = LeaseRecord.from_bytes(storage.read_bytes(lease.superseded_url))
    assert newest.host == "elsewhere" and not newest.released, "a lost lease is not released"
