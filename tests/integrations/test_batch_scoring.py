"""Clearing a batch scoring's output folder deletes the files an earlier scoring wrote there, and
never anything else (issue 36, finding 3)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from prefect_ml.integrations import serving, storage
from prefect_ml.integrations.errors import ConfigurationError
from prefect_ml.integrations.serving import PendingWrite, PredictionManifest


def _write(folder: Path, files: dict[str, bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def _commit(output: Path, names: list[str], *, output_url: str | None = None) -> None:
    """A manifest as :func:`serving.score` writes it, listing ``names`` in ``output``."""
    manifest = PredictionManifest(
        fingerprint="f" * 24,
        model_name="m",
        model_version="1",
        run_id="r",
        model_uri="models:/m/1",
        input_url="/in",
        inputs=["/in/a.csv"],
        output_url=output_url or str(output),
        files=[(output / name).as_uri() for name in names],
        sizes=[(output / name).stat().st_size for name in names],
        rows=1,
        seconds=1.0,
        created="2026-12-04T00:00:00+00:00",
        feature_columns=["x"],
        passthrough_columns=[],
    )
    (output / "_SUCCESS").write_text(manifest.model_dump_json())


def _refused(output: Path) -> ConfigurationError:
    before = sorted(p.name for p in output.iterdir())
    with pytest.raises(ConfigurationError, match="no batch scoring wrote there") as refused:
        serving.clear_output(str(output))
    assert sorted(p.name for p in output.iterdir()) == before  # nothing deleted
    assert refused.value.field == "output"
    return refused.value


def test_a_spark_output_folder_with_an_empty_success_file_is_never_deleted(
    tmp_path: Path,
) -> None:
    output = tmp_path / "spark-job"
    _write(output, {"part-00000.parquet": b"PAR1 data", "_SUCCESS": b""})
    assert "part-00000.parquet" in _refused(output).message
    assert serving.completed(str(output), "f" * 24) is None


def test_another_scoring_s_manifest_or_a_stranger_s_file_is_not_a_licence_to_delete(
    tmp_path: Path,
) -> None:
    output = tmp_path / "out"
    _write(output, {"a.parquet": b"ours"})
    _commit(output, ["a.parquet"], output_url=str(tmp_path / "elsewhere"))  # copied here
    _refused(output)
    _commit(output, ["a.parquet"])
    _write(output, {"notes.txt": b"someone's"})
    _refused(output)
    (output / "notes.txt").unlink()
    (output / "a.parquet").write_bytes(b"changed since")  # not the file the manifest lists
    _refused(output)


def test_the_files_a_manifest_lists_are_cleared_and_only_they(tmp_path: Path) -> None:
    output = tmp_path / "out"
    _write(output, {"a.parquet": b"one", "b.parquet": b"two"})
    _commit(output, ["a.parquet", "b.parquet"])
    (output / "b.parquet").unlink()  # an interrupted clear removed it already
    serving.clear_output(str(output))
    assert list(output.iterdir()) == []


def test_a_crashed_write_is_cleared_by_its_id_and_nothing_else(tmp_path: Path) -> None:
    output = tmp_path / "out"
    pending = PendingWrite(fingerprint="f" * 24, write_id=uuid.uuid4().hex)
    _write(output, {f"{pending.write_id}_abc_000000.parquet": b"half"})
    storage.write_bytes(
        storage.predictions_pending_url(str(output)), pending.model_dump_json().encode()
    )
    _write(output, {"part-00000.parquet": b"someone's"})
    _refused(output)
    (output / "part-00000.parquet").unlink()
    serving.clear_output(str(output))
    assert list(output.iterdir()) == []
    _write(output, {"_PENDING": b'"an old or planted marker"', "x.parquet": b"someone's"})
    _refused(output)
