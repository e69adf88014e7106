from __future__ import annotations

import json
import logging
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from prefect_ml.integrations import storage
from prefect_ml.integrations.errors import CheckpointError
from prefect_ml.integrations.settings import PrefectMLSettings
from prefect_ml.integrations.storage import (
    MANIFEST,
    SIGNATURE,
    CheckpointStore,
    RetentionPolicy,
    manifest_signature,
)
from prefect_ml.integrations.training import METRICS_FILE, load_files, to_files

STATE_FILE = "__0_0.distcp"


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    """The same store on local disk and on the S3 server."""
    if request.param == "s3":
        return CheckpointStore(storage.join(request.getfixturevalue("s3_bucket"), "run"))
    return CheckpointStore((tmp_path / "run").as_uri())


def _save(store: CheckpointStore, epoch: int) -> str:
    files = to_files({"model": {"w": torch.full((3,), float(epoch))}})
    return store.save(epoch, {**files, "note.txt": b"epoch %d" % epoch})


def test_latest_returns_the_newest_verified_checkpoint(store: CheckpointStore) -> None:
    for epoch in (1, 2, 3):
        _save(store, epoch)
    latest = store.latest()
    assert latest is not None and latest.epoch == 3
    state = {"model": {"w": torch.zeros(3)}}
    load_files(latest.files, state)
    assert state["model"]["w"].tolist() == [3.0, 3.0, 3.0]
    assert store.epochs() == [1, 2, 3]


def _flip_first_byte(url: str) -> None:
    data = storage.read_bytes(url)
    storage.write_bytes(url, bytes([data[0] ^ 0xFF]) + data[1:])


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(
            lambda url: storage.write_bytes(url, storage.read_bytes(url)[:-10]),
            id="truncated-file",
        ),
        pytest.param(_flip_first_byte, id="flipped-byte"),
        pytest.param(storage.remove, id="missing-file"),
        pytest.param(
            lambda url: storage.remove(url.replace(STATE_FILE, MANIFEST)), id="missing-manifest"
        ),
    ],
)
def test_damaged_checkpoint_is_skipped_with_a_warning(
    store: CheckpointStore, damage, caplog: pytest.LogCaptureFixture
) -> None:
    _save(store, 1)
    _save(store, 2)
    damage(storage.join(store.url_for(2), STATE_FILE))
    with caplog.at_level(logging.WARNING):
        latest = store.latest()
    assert latest is not None and latest.epoch == 1
    assert "Skipping checkpoint" in caplog.text and "epoch-000002" in caplog.text
    with pytest.raises(CheckpointError):
        store.load(2)


def _save_with_loss(store: CheckpointStore, epoch: int, val_loss: float) -> None:
    metrics = json.dumps({"val_loss": val_loss}).encode()
    store.save(epoch, {STATE_FILE: b"weights %d" % epoch, METRICS_FILE: metrics})


def test_retention_keeps_the_last_k_and_the_best_and_the_history_of_all(
    store: CheckpointStore,
) -> None:
    policy = RetentionPolicy(keep_last=2, metric="val_loss", mode="min")
    losses = {1: 0.9, 2: 0.3, 3: 0.5, 4: 0.6, 5: 0.4, 6: 0.7}
    for epoch, loss in losses.items():
        _save_with_loss(store, epoch, loss)
        store.prune(policy)

    with_weights = [e for e in store.epochs() if _loads(store, e)]
    assert with_weights == [2, 5, 6]  # the best (epoch 2) and the last two
    assert not storage.exists(storage.join(store.url_for(3), STATE_FILE))
    with pytest.raises(CheckpointError, match="pruned"):
        store.load(3)
    # Every epoch's metrics stay verifiable, pruned or not: the run's history is complete.
    for epoch, loss in losses.items():
        assert json.loads(store.read_verified(epoch, METRICS_FILE))["val_loss"] == loss
    latest = store.latest()
    assert latest is not None and latest.epoch == 6
    assert store.best_epoch(policy) == 2


def test_retention_without_a_best_metric_keeps_only_the_newest(store: CheckpointStore) -> None:
    for epoch, loss in {1: 0.1, 2: 0.5, 3: 0.6}.items():
        _save_with_loss(store, epoch, loss)
    assert store.prune(RetentionPolicy(keep_last=1)) == [1, 2]
    assert [e for e in store.epochs() if _loads(store, e)] == [3]


def _loads(store: CheckpointStore, epoch: int) -> bool:
    try:
        store.load(epoch)
    except CheckpointError:
        return False
    return True


def test_retention_needs_at_least_one_checkpoint() -> None:
    with pytest.raises(ValueError, match="keep_last"):
        RetentionPolicy(keep_last=0)


def test_no_checkpoint_yet(store: CheckpointStore) -> None:
    assert store.latest() is None and store.epochs() == []


def test_manifest_name_is_reserved(store: CheckpointStore) -> None:
    with pytest.raises(ValueError, match="reserved"):
        store.save(1, {MANIFEST: b"{}"})


class _Payload:
    def __reduce__(self):  # noqa: ANN204 - what an attacker would put in a checkpoint
        return (print, ("arbitrary code ran",))


@pytest.mark.parametrize("poisoned", ["metadata", "value"])
def test_checkpoints_are_never_unpickled_as_arbitrary_objects(
    poisoned: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """DCP unpickles its metadata and ``torch.load``s non-tensor values; neither may run code."""
    if poisoned == "metadata":
        files = to_files({"model": {"w": torch.zeros(3)}, "step": 7})
        files[".metadata"] = pickle.dumps(_Payload())
    else:  # a non-tensor value is stored as a torch.save'd blob in the data file
        files = to_files({"model": {"w": torch.zeros(3)}, "step": _Payload()})
    with pytest.raises(CheckpointError, match="not allowed|Unsupported global"):
        load_files(files, {"model": {"w": torch.zeros(3)}, "step": 0})
    assert "arbitrary code ran" not in capsys.readouterr().out


KEY = "a-checkpoint-signing-key-of-32-bytes!"


def _forge(url: str, epoch: int, files: dict[str, bytes], key: bytes | None) -> None:
    """What anyone who can write the storage can do: new files and a matching sha256 list,
    signed with whatever key they hold."""
    import hashlib

    for name, data in files.items():
        storage.write_bytes(storage.join(url, name), data)
    listed = {
        name: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
        for name, data in files.items()
    }
    manifest: dict[str, object] = {"epoch": epoch, "created_unix": 0.0, "files": listed}
    if key is not None:
        manifest[SIGNATURE] = manifest_signature(manifest, key)
    storage.write_bytes(storage.join(url, MANIFEST), json.dumps(manifest).encode())


@pytest.mark.parametrize("forger_key", [None, b"another key"], ids=["unsigned", "other-key"])
def test_with_a_key_a_forged_manifest_is_refused_before_any_file_is_read(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch, forger_key: bytes | None
) -> None:
    monkeypatch.setenv("PREFECT_ML_CHECKPOINT_KEY", KEY)
    signed = CheckpointStore(store.root_url)
    _save(signed, 1)
    assert signed.load(1).epoch == 1
    _forge(signed.url_for(1), 1, to_files({"model": {"w": torch.full((3,), 99.0)}}), forger_key)
    storage.remove(storage.join(signed.url_for(1), STATE_FILE))  # reading it would fail otherwise
    with pytest.raises(CheckpointError, match="not signed|does not match its HMAC") as error:
        CheckpointStore(store.root_url).load(1)
    assert "missing" not in str(error.value)
    assert CheckpointStore(store.root_url).latest() is None


def test_a_signed_manifest_altered_after_signing_is_refused(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_ML_CHECKPOINT_KEY", KEY)
    signed = CheckpointStore(store.root_url)
    url = _save(signed, 1)
    manifest = json.loads(storage.read_bytes(storage.join(url, MANIFEST)))
    manifest["epoch"] = 2
    storage.write_bytes(storage.join(url, MANIFEST), json.dumps(manifest).encode())
    with pytest.raises(CheckpointError, match="does not match its HMAC"):
        CheckpointStore(store.root_url).load(1)


def test_without_a_key_the_same_forgery_loads(store: CheckpointStore) -> None:
    """What the key protects against: sha256 alone verifies whatever was written last."""
    _save(store, 1)
    _forge(store.url_for(1), 1, to_files({"model": {"w": torch.full((3,), 99.0)}}), None)
    state = {"model": {"w": torch.zeros(3)}}
    load_files(store.load(1).files, state)
    assert state["model"]["w"].tolist() == [99.0, 99.0, 99.0]


def test_signed_checkpoints_stay_verifiable_after_pruning(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PREFECT_ML_CHECKPOINT_KEY", KEY)
    signed = CheckpointStore(store.root_url)
    for epoch, loss in ((1, 0.5), (2, 0.4), (3, 0.6)):
        _save_with_loss(signed, epoch, loss)
    assert signed.prune(RetentionPolicy(keep_last=1)) == [1, 2]
    fresh = CheckpointStore(store.root_url)
    assert json.loads(fresh.read_verified(1, METRICS_FILE))["val_loss"] == 0.5
    assert fresh.load(3).epoch == 3


def test_mid_epoch_checkpoints_sort_between_epoch_ends_and_retention_counts_them(
    store: CheckpointStore,
) -> None:
    from prefect_ml.integrations.storage import CheckpointPosition as At

    _save_with_loss(store, 1, 0.5)
    for step in (5, 10):
        store.save(2, {STATE_FILE: b"weights 2.%d" % step}, step=step)
    latest = store.latest()
    assert latest is not None and latest.position == At(2, 10) and latest.completed_epochs == 1
    assert latest.files[STATE_FILE] == b"weights 2.10"
    assert store.epochs() == [1], "metrics readers see epoch ends only"
    _save_with_loss(store, 2, 0.4)
    assert store.positions() == [At(1), At(2, 5), At(2, 10), At(2)]

    assert store.prune(RetentionPolicy(keep_last=2, metric="val_loss")) == [1]
    assert store.positions() == [At(1), At(2, 10), At(2)], "the step-5 checkpoint went whole"
    assert storage.list_names(store.root_url) == [
        "epoch-000001",
        "epoch-000002",
        "epoch-000002-step-000010",
    ]
    assert CheckpointStore(store.root_url).load(2, step=10).step == 10
    with pytest.raises(ValueError, match="step 1 or later"):
        store.save(3, {STATE_FILE: b"x"}, step=0)


def _copy(source: str, target: str) -> None:
    """What whoever can write the storage can do without the key: copy a signed checkpoint."""
    shutil.copytree(source.removeprefix("file://"), target.removeprefix("file://"))


def test_a_signed_checkpoint_copied_to_a_later_epoch_or_another_run_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 36, finding 6: epoch 1 copied to epoch 60 was the resume point, with epoch 1's
    weights (a rollback that also skips 59 epochs)."""
    monkeypatch.setenv("PREFECT_ML_CHECKPOINT_KEY", KEY)
    run, other = CheckpointStore((tmp_path / "run").as_uri()), CheckpointStore(str(tmp_path / "b"))
    for epoch in (1, 2):
        _save(run, epoch)
    _copy(run.url_for(1), run.url_for(60))
    _copy(run.url_for(1), run.url_for(2, step=5))
    _save(other, 1)
    _copy(run.url_for(2), other.url_for(2))
    with caplog.at_level(logging.WARNING):
        latest, elsewhere = CheckpointStore(run.root_url).latest(), other.latest()
    assert latest is not None and latest.epoch == 2 and latest.step is None
    assert elsewhere is not None and elsewhere.epoch == 1
    assert "written for epoch 1, step None: copied here" in caplog.text
    with pytest.raises(CheckpointError, match="copied from another run"):
        CheckpointStore(other.root_url).load(2)
    assert CheckpointStore(f"{tmp_path}/run/").load(2).epoch == 2  # any form of the same URL


@pytest.mark.parametrize(
    "entries",
    [
        {"../../x.distcp": {"sha256": "0" * 64, "size": 1}},
        {"/etc/passwd": {"sha256": "0" * 64, "size": 1}},
        {"model.distcp": 1},
        {"model.distcp": {"sha256": None, "size": "1"}},
        [],
    ],
)
def test_a_manifest_that_lists_no_proper_file_is_skipped_not_fatal(
    tmp_path: Path, entries: object
) -> None:
    """Issue 36, finding 11: one bad manifest stopped every resume with a ConfigurationError."""
    store = CheckpointStore((tmp_path / "run").as_uri())
    for epoch in (1, 2):
        _save(store, epoch)
    url = storage.join(store.url_for(2), MANIFEST)
    manifest = json.loads(storage.read_bytes(url))
    storage.write_bytes(url, json.dumps({**manifest, "files": entries}).encode())
    latest = CheckpointStore(store.root_url).latest()
    assert latest is not None and latest.epoch == 1
    with pytest.raises(CheckpointError, match=MANIFEST):
        CheckpointStore(store.root_url).load(2)


@pytest.mark.parametrize("key", ["", "   ", "short"])
def test_a_checkpoint_key_that_is_set_but_empty_or_short_is_refused(
    monkeypatch: pytest.MonkeyPatch, key: str
) -> None:
    monkeypatch.setenv("PREFECT_ML_CHECKPOINT_KEY", key)
    with pytest.raises(ValidationError, match="PREFECT_ML_CHECKPOINT_KEY: the key has fewer"):
        PrefectMLSettings()
