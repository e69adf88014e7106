from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path

import pytest
import torch

from integrations.checkpoints import MANIFEST, CheckpointStore
from integrations.errors import CheckpointError
from integrations.ray_training import STATE_FILE, deserialize_state, serialize_state


@pytest.fixture
def store(tmp_path: Path) -> CheckpointStore:
    return CheckpointStore((tmp_path / "run").as_uri())


def _save(store: CheckpointStore, epoch: int) -> str:
    state = {"model": {"w": torch.full((3,), float(epoch))}, "epoch": epoch}
    return store.save(epoch, {STATE_FILE: serialize_state(state), "note.txt": b"epoch %d" % epoch})


def test_latest_returns_the_newest_verified_checkpoint(store: CheckpointStore) -> None:
    for epoch in (1, 2, 3):
        _save(store, epoch)
    latest = store.latest()
    assert latest is not None and latest.epoch == 3
    assert deserialize_state(latest.files[STATE_FILE])["epoch"] == 3
    assert store.epochs() == [1, 2, 3]


def _path(store: CheckpointStore, epoch: int, name: str) -> Path:
    return Path(store.url_for(epoch).removeprefix("file://")) / name


@pytest.mark.parametrize(
    "damage",
    [
        pytest.param(lambda p: p.write_bytes(p.read_bytes()[:-10]), id="truncated-file"),
        pytest.param(
            lambda p: p.write_bytes(bytes([p.read_bytes()[0] ^ 0xFF]) + p.read_bytes()[1:]),
            id="flipped-byte",
        ),
        pytest.param(lambda p: p.unlink(), id="missing-file"),
        pytest.param(lambda p: (p.parent / MANIFEST).unlink(), id="missing-manifest"),
    ],
)
def test_damaged_checkpoint_is_skipped_with_a_warning(
    store: CheckpointStore, damage, caplog: pytest.LogCaptureFixture
) -> None:
    _save(store, 1)
    _save(store, 2)
    damage(_path(store, 2, STATE_FILE))
    with caplog.at_level(logging.WARNING):
        latest = store.latest()
    assert latest is not None and latest.epoch == 1
    assert "Skipping checkpoint" in caplog.text and "epoch-000002" in caplog.text
    with pytest.raises(CheckpointError):
        store.load(2)


def test_no_checkpoint_yet(store: CheckpointStore) -> None:
    assert store.latest() is None and store.epochs() == []


def test_manifest_name_is_reserved(store: CheckpointStore) -> None:
    with pytest.raises(ValueError, match="reserved"):
        store.save(1, {MANIFEST: b"{}"})


class _Payload:
    def __reduce__(self):  # noqa: ANN204 - what an attacker would put in a checkpoint
        return (print, ("arbitrary code ran",))


def test_states_are_never_unpickled_as_arbitrary_objects() -> None:
    buffer = io.BytesIO()
    torch.save({"model": _Payload()}, buffer)
    with pytest.raises(pickle.UnpicklingError):
        deserialize_state(buffer.getvalue())
