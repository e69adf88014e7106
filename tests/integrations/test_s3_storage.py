"""The storage module and the checkpoint store against a real S3 API (moto's server): multipart
writes, injected 503s and resets, an S3 server that goes away, a writer killed mid-upload,
permanent errors, and keys that try to leave their prefix."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from s3fs import S3FileSystem

from prefect_ml.integrations import storage
from prefect_ml.integrations.errors import (
    CheckpointError,
    ConfigurationError,
    EnvironmentCheckError,
)
from prefect_ml.integrations.storage import MANIFEST, CheckpointStore
from prefect_ml.integrations.storage import _files as storage_files
from prefect_ml.integrations.training import METRICS_FILE, EpochCommitter
from tests.helpers import blob_trainer, wait_for
from tests.s3 import TEST_BUCKET, FaultyProxy, MotoS3

MIB = 2**20

STATE_FILE = "__0_0.distcp"  # the data file of a one-writer DCP checkpoint


def _objects(moto_s3: MotoS3) -> dict[str, int]:
    """Every visible object in the test bucket and its size, read past any proxy."""
    listed = moto_s3.client().list_objects_v2(Bucket=TEST_BUCKET)  # type: ignore[attr-defined]
    return {item["Key"]: item["Size"] for item in listed.get("Contents", [])}


def _incomplete_uploads(moto_s3: MotoS3) -> list[str]:
    found = moto_s3.client().list_multipart_uploads(Bucket=TEST_BUCKET)  # type: ignore[attr-defined]
    return [upload["Key"] for upload in found.get("Uploads", [])]


@pytest.fixture
def endpoint(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Point the storage module at another endpoint (a proxy) for the rest of the test."""

    def use(url: str) -> None:
        monkeypatch.setenv("AWS_ENDPOINT_URL", url)
        S3FileSystem.clear_instance_cache()

    return use


def test_multipart_objects_round_trip_and_large_reads_are_exact(
    s3_bucket: str, moto_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(storage_files, "S3_PART_SIZE", 5 * MIB)  # S3's smallest part
    data = os.urandom(3 * storage_files.S3_PART_SIZE + 12345)  # four parts, the last one short
    storage.write_bytes(storage.join(s3_bucket, "a", "big.bin"), data)
    storage.write_bytes(storage.join(s3_bucket, "a", "small.txt"), b"small")

    assert storage.read_bytes(storage.join(s3_bucket, "a", "big.bin")) == data
    assert storage.list_names(storage.join(s3_bucket, "a")) == ["big.bin", "small.txt"]
    assert _objects(moto_s3) == {"a/big.bin": len(data), "a/small.txt": 5}
    assert _incomplete_uploads(moto_s3) == []


def test_reads_take_one_get_per_object_and_no_head(
    s3_bucket: str,
    moto_s3: MotoS3,
    endpoint: Callable[[str], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(storage_files, "S3_PART_SIZE", 5 * MIB)  # S3's smallest part
    big = os.urandom(2 * storage_files.S3_PART_SIZE + 12345)  # three parts written, one GET read
    urls = {name: storage.join(s3_bucket, "r", name) for name in ("big.bin", "one.bin", "empty")}
    storage.write_bytes(urls["big.bin"], big)
    storage.write_bytes(urls["one.bin"], b"one part")
    storage.write_bytes(urls["empty"], b"")
    with FaultyProxy(moto_s3.port, rate=0.0) as proxy:
        endpoint(proxy.endpoint)
        data, sha256 = storage.read_bytes_and_sha256(urls["big.bin"])
        assert data == big and sha256 == hashlib.sha256(big).hexdigest()
        assert proxy.received == [("GET", f"/{TEST_BUCKET}/r/big.bin", None)]

        proxy.received.clear()
        assert storage.read_bytes(urls["one.bin"]) == b"one part"
        assert storage.read_bytes(urls["empty"]) == b""
        assert proxy.received == [
            ("GET", f"/{TEST_BUCKET}/r/one.bin", None),
            ("GET", f"/{TEST_BUCKET}/r/empty", None),
        ]

        missing = storage.join(s3_bucket, "r", "missing.bin")
        with pytest.raises(FileNotFoundError, match="r/missing.bin"):
            storage.read_bytes(missing)
        with pytest.raises(FileNotFoundError, match="no-such-bucket"):
            storage.read_bytes("s3://no-such-bucket/key")


def test_a_body_cut_short_mid_stream_is_asked_for_again(
    s3_bucket: str, moto_s3: MotoS3, endpoint: Callable[[str], None]
) -> None:
    data = os.urandom(6 * MIB)
    url = storage.join(s3_bucket, "cut.bin")
    storage.write_bytes(url, data)
    with FaultyProxy(moto_s3.port, rate=0.0, cut_bodies=2) as proxy:
        endpoint(proxy.endpoint)
        read, sha256 = storage.read_bytes_and_sha256(url)
    assert read == data and sha256 == hashlib.sha256(data).hexdigest()
    assert proxy.cut_bodies < 0, "the proxy cut no body"
    # Two bodies cut: the object was asked for again after each.
    assert proxy.received == [("GET", f"/{TEST_BUCKET}/cut.bin", None)] * 3


def test_a_checkpoint_reads_its_manifest_once_then_its_files_together(
    s3_bucket: str, moto_s3: MotoS3, endpoint: Callable[[str], None]
) -> None:
    state = os.urandom(6 * MIB + 7)
    url = storage.join(s3_bucket, "run")
    writer = CheckpointStore(url, key=b"k")
    writer.save(1, {STATE_FILE: state, METRICS_FILE: b'{"loss": 1}'})
    with FaultyProxy(moto_s3.port, rate=0.0) as proxy:
        endpoint(proxy.endpoint)
        reader = CheckpointStore(url, key=b"k")
        assert reader.load(1).files == {STATE_FILE: state, METRICS_FILE: b'{"loss": 1}'}
        epoch = f"/{TEST_BUCKET}/run/epoch-000001"
        assert proxy.received[0] == ("GET", f"{epoch}/{MANIFEST}", None)
        assert sorted(proxy.received[1:]) == [
            ("GET", f"{epoch}/{STATE_FILE}", None),
            ("GET", f"{epoch}/{METRICS_FILE}", None),
        ]
        # The manifest is known now: it is read again beside the file, not before it.
        proxy.received.clear()
        assert reader.read_verified(1, METRICS_FILE) == b'{"loss": 1}'
        assert sorted(proxy.received) == [
            ("GET", f"{epoch}/{MANIFEST}", None),
            ("GET", f"{epoch}/{METRICS_FILE}", None),
        ]

        # Another writer replaced the checkpoint: the stale copy fails, the manifest is read again.
        writer.save(1, {STATE_FILE: b"new state", METRICS_FILE: b"{}"})
        assert reader.load(1).files == {STATE_FILE: b"new state", METRICS_FILE: b"{}"}

        # A manifest signed with another key is refused before any file of it is read.
        proxy.received.clear()
        with pytest.raises(CheckpointError, match="HMAC"):
            CheckpointStore(url, key=b"other").load(1)
        assert [path for _m, path, _r in proxy.received] == [f"{epoch}/{MANIFEST}"]

        storage.remove(storage.join(url, "epoch-000001", STATE_FILE))
        with pytest.raises(
            CheckpointError, match=f"{STATE_FILE} is listed in the manifest but missing"
        ):
            CheckpointStore(url, key=b"k").load(1)


@pytest.mark.full  # S3 faults injected into a training's uploads, 10-16 s each (tests/tiers.py)
@pytest.mark.parametrize(
    ("attempts", "rate"),
    [pytest.param(6, 0.1, id="retried-10pct"), pytest.param(1, 0.3, id="no-retries-30pct")],
)
def test_injected_503s_and_resets_never_leave_a_partial_checkpoint(
    s3_bucket: str,
    moto_s3: MotoS3,
    endpoint: Callable[[str], None],
    monkeypatch: pytest.MonkeyPatch,
    attempts: int,
    rate: float,
) -> None:
    monkeypatch.setenv("PREFECT_ML_S3_MAX_ATTEMPTS", str(attempts))
    monkeypatch.setattr(storage_files, "S3_PART_SIZE", 5 * MIB)  # S3's smallest part: more requests
    payloads = {epoch: os.urandom(2 * storage_files.S3_PART_SIZE + epoch) for epoch in range(1, 9)}
    outcomes: dict[int, str] = {}
    with FaultyProxy(moto_s3.port, rate=rate, seed=attempts) as proxy:
        endpoint(proxy.endpoint)
        store = CheckpointStore(storage.join(s3_bucket, "run"))
        for epoch, payload in payloads.items():
            try:
                store.save(epoch, {STATE_FILE: payload, METRICS_FILE: b"{}"})
                outcomes[epoch] = "saved"
            except Exception as exc:  # the upload raised: that is allowed, silence is not
                outcomes[epoch] = type(exc).__name__
    assert proxy.slow_downs > 0 and proxy.resets > 0, "the proxy injected no faults"

    endpoint(moto_s3.endpoint)  # read back past the proxy
    # What a killed or failed writer left is invisible, and the next run aborts it.
    storage.abort_incomplete_uploads(storage.join(s3_bucket, "run"))
    assert _incomplete_uploads(moto_s3) == []
    reader = CheckpointStore(storage.join(s3_bucket, "run"))
    for key, size in _objects(moto_s3).items():  # every visible object is whole
        epoch = int(key.split("/")[1].removeprefix("epoch-"))
        if key.endswith(STATE_FILE):
            assert size == len(payloads[epoch]), f"{key} is partial"
    for epoch, outcome in outcomes.items():
        if outcome == "saved":
            assert reader.load(epoch).files[STATE_FILE] == payloads[epoch]
    if attempts > 1:  # with retries, 10% faults cost time, not checkpoints
        assert set(outcomes.values()) == {"saved"}, outcomes
    else:
        assert set(outcomes.values()) != {"saved"}, "30% faults without retries must fail some"
    latest = reader.latest()
    saved = [e for e, outcome in outcomes.items() if outcome == "saved"]
    assert latest is not None and latest.epoch >= max(saved)
    if attempts > 1:  # reads under the same faults (s3fs sizes a file by HEAD) are whole too
        rows = np.arange(4000, dtype=np.float32).reshape(1000, 4)
        storage.write_array(storage.join(s3_bucket, "rows.npy"), rows)
        with FaultyProxy(moto_s3.port, rate=rate, seed=attempts + 1) as proxy:
            endpoint(proxy.endpoint)
            through = CheckpointStore(storage.join(s3_bucket, "run"))
            for epoch in saved:
                assert through.load(epoch).files[STATE_FILE] == payloads[epoch]
            for start in range(0, 1000, 100):
                read = storage.read_array_rows(
                    storage.join(s3_bucket, "rows.npy"), start, start + 100
                )
                np.testing.assert_array_equal(read, rows[start : start + 100])
        endpoint(moto_s3.endpoint)


@pytest.fixture
def restartable_s3(moto_s3: MotoS3) -> Iterator[MotoS3]:
    yield moto_s3
    if not _answers(moto_s3):
        moto_s3.start()


def _answers(server: MotoS3) -> bool:
    import httpx

    try:
        httpx.get(f"{server.endpoint}/moto-api/", timeout=1)
    except httpx.HTTPError:
        return False
    return True


def test_training_rides_out_a_short_s3_outage_and_resumes_after_a_long_one(
    s3_bucket: str, restartable_s3: MotoS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = storage.join(s3_bucket, "run")
    trainer = blob_trainer(url, epochs=6)
    committer = EpochCommitter(trainer.store)

    def train_and_commit(epoch: int) -> None:
        started = time.perf_counter()
        metrics = trainer.train_epoch(epoch)
        committer.submit(
            epoch,
            trainer.snapshot(epoch),
            metrics,
            epoch_started=started,
            blocked_since=time.perf_counter(),
        )

    train_and_commit(1)
    # A short outage: the server stops, and is back within botocore's retries. Training goes on.
    restartable_s3.stop()
    threading.Timer(1.0, restartable_s3.start).start()
    train_and_commit(2)
    committer.wait()
    assert CheckpointStore(url).epochs() == [1, 2]

    # A long outage with few retries: the commit fails with a clear error naming the resume point.
    monkeypatch.setenv("PREFECT_ML_S3_MAX_ATTEMPTS", "2")
    S3FileSystem.clear_instance_cache()
    restartable_s3.stop()
    train_and_commit(3)
    with pytest.raises(CheckpointError, match="last one committed here is epoch 2"):
        committer.wait()
    restartable_s3.start()

    # The next run resumes from the last verified checkpoint, and nothing truncated is visible.
    resumed = blob_trainer(url, epochs=6)
    assert resumed.first_epoch in (3, 4)  # epoch 3 may have landed before the server went away
    for epoch in resumed.store.epochs():
        resumed.store.load(epoch)  # raises if any committed checkpoint does not verify


_SLOW_WRITER = """
import os, sys
from prefect_ml.integrations import storage
from prefect_ml.integrations.storage import _files
_files.S3_PART_SIZE = 5 * 2**20  # S3's smallest part: many parts, a long upload
storage.write_bytes(sys.argv[1], os.urandom(200 * 2**20))
"""


def test_a_writer_killed_mid_upload_leaves_nothing_visible(s3_bucket: str, moto_s3: MotoS3) -> None:
    target = storage.join(s3_bucket, "run", "epoch-000001", STATE_FILE)
    writer = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, target])
    try:
        wait_for(lambda: bool(_incomplete_uploads(moto_s3)), 60, "the multipart upload to start")
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait()

    assert not storage.exists(target)
    assert _objects(moto_s3) == {}
    assert CheckpointStore(storage.join(s3_bucket, "run")).latest() is None
    assert storage.abort_incomplete_uploads(storage.join(s3_bucket, "run")) == 1
    assert _incomplete_uploads(moto_s3) == []


def test_missing_bucket_and_refused_credentials_are_named(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(EnvironmentCheckError, match="bucket 'no-such-bucket'.*does not exist"):
        storage.check_writable("s3://no-such-bucket/prefix")

    import moto.settings

    # moto checks signatures and keys once authentication is on; ours are unknown to its IAM.
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    S3FileSystem.clear_instance_cache()
    with pytest.raises(EnvironmentCheckError, match="refused the credentials.*AWS_ACCESS_KEY_ID"):
        storage.check_writable(storage.join(s3_bucket, "prefix"))


def test_credentials_from_a_prefect_secret_block_are_used(
    s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prefect.blocks.system import Secret

    from prefect_ml.integrations.settings import PrefectMLSettings

    for variable in storage.CREDENTIAL_VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    Secret(value={"aws_access_key_id": "from-block", "aws_secret_access_key": "s"}).save(
        "s3-test-credentials", overwrite=True
    )
    monkeypatch.setenv("PREFECT_ML_S3_CREDENTIALS_BLOCK", "s3-test-credentials")
    monkeypatch.setenv("PREFECT_ML_STORAGE_URL", storage.join(s3_bucket, "data"))

    assert storage.prepare_storage(PrefectMLSettings()) == f"{s3_bucket}/data"
    assert os.environ["AWS_ACCESS_KEY_ID"] == "from-block"

    Secret(value="not-a-json-object").save("s3-bad-credentials", overwrite=True)
    monkeypatch.setenv("PREFECT_ML_S3_CREDENTIALS_BLOCK", "s3-bad-credentials")
    with pytest.raises(ConfigurationError, match="PREFECT_ML_S3_CREDENTIALS_BLOCK.*JSON object"):
        storage.prepare_storage(PrefectMLSettings())


@pytest.mark.parametrize(
    "key",
    [
        "../escape",
        "a/../../escape",
        "..%2fescape",
        "..%2Fescape",
        "%2e%2e/escape",
        "%252e%252e%252fescape",
        "/etc/passwd",
        "%2fetc%2fpasswd",
        "s3://other-bucket/key",
        "C:/Windows",
        "a\\..\\b",
        "a/./b",
    ],
)
def test_keys_that_leave_their_prefix_are_refused(key: str) -> None:
    with pytest.raises(ConfigurationError, match="keys must stay inside their prefix"):
        storage.join("s3://bucket/prefix", key)


def test_ordinary_keys_pass() -> None:
    assert storage.join("s3://b/p/", "campaigns", "my.campaign-1", "trial-00001") == (
        "s3://b/p/campaigns/my.campaign-1/trial-00001"
    )
    assert storage.join("file:///tmp/x", "a..b", "dataset.v2.parquet").endswith(
        "a..b/dataset.v2.parquet"
    )


def test_a_storage_url_with_traversal_is_refused_naming_the_setting() -> None:
    with pytest.raises(ConfigurationError, match="PREFECT_ML_STORAGE_URL"):
        storage.check_url("s3://bucket/team/../other-team", "PREFECT_ML_STORAGE_URL")
