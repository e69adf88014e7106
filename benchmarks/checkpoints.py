"""Checkpoints on S3: our store vs boto3's managed transfers vs s3fs, and the time a training loop
is blocked per checkpoint, synchronous vs our background commit, in one run.

One S3 server for every arm: moto's, on loopback, started by this script in a child process (so
its request handling does not share this process's interpreter lock with the clients; pass
``--moto-in-process`` to run it on a thread here instead, as the tests do). The payload is a
torch state dict of float32 tensors (100 MB; 20 MB with ``--quick``) serialised once as the
training loop does, with ``training.to_files`` (its DCP data file is the payload).

**Transfers** (upload, then download, of the same bytes; each arm in turn, the order rotated per
repeat; median of the repeats after an untimed warm-up of every arm):

* ``ours-store``: ``CheckpointStore.save`` / ``.load`` (the data file plus ``MANIFEST.json``;
  sha256 computed on save and verified on load). The loading store wrote the checkpoint, so it
  knows the file names and reads the manifest beside the data;
* ``ours-store-cold``: the same save, loaded by a new ``CheckpointStore``, as a resuming
  process loads it: the manifest first (its signature would be checked before any file is
  read), then the files;
* ``ours-raw``: ``storage.write_bytes`` / ``storage.read_bytes`` (the same transfers, no manifest
  or hashing);
* ``boto3``: ``upload_file`` / ``download_file`` with the default ``TransferConfig``, from and to a
  local temporary file (its API). The file is written once before the upload timings; the
  download's write to the local file is part of its time;
* ``boto3-memory``: ``upload_fileobj`` / ``download_fileobj`` with the same defaults, from and to
  memory (``BytesIO``), as our store works: boto3's transfer engine without the local file;
* ``s3fs``: ``S3FileSystem.put_file`` / ``get_file`` with its defaults, the same local files;
* ``s3fs-memory``: ``pipe_file`` / ``cat_file`` with s3fs's defaults (a read sizes the object
  by HEAD, then GETs 50 MiB ranges) on the storage module's own filesystem (its endpoint, retry
  and concurrency options), from and to memory. Our store reads with ``max_concurrency=1``
  instead: one GET per object, no HEAD.

Throughput is payload MB (10^6 bytes) over seconds; ratios are over boto3's.

**Blocked time**: a loop of N epochs, each running W seconds of 1024x1024 torch matmuls on one
thread, then checkpointing the state (``state.pt`` plus ``metrics.json``) to S3: ``sync``
serialises and calls ``store.save`` inline; ``async`` does what the epoch loop does: it stages a
CPU copy of the state (``StagedSnapshot``) and hands it to ``EpochCommitter.submit`` (which
first waits for the previous commit, then serialises and uploads in its thread);
``async-short`` does the same with epochs of W/3 seconds, shorter than a commit. Blocked time
runs from the start of serialising (sync) or staging (async) to the return of that call; the
median is over epochs 2..N (epoch 1 of ``async`` has no previous commit to wait for). The final
``wait`` of ``async`` after the last epoch is reported apart, and so are the matmuls done per
epoch (the background commit competes with them for CPU).

Run ``make bench`` or ``.venv/bin/python benchmarks/checkpoints.py --quick`` (a smoke run).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Run as a script, ``benchmarks/`` is on sys.path but the repository is not.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import embedded_home, results_path, save_report  # noqa: E402

if TYPE_CHECKING:
    import torch

BUCKET = "prefect-ml-bench"
UPLOAD_TARGET = 0.9  # our store's MB/s over boto3's
DOWNLOAD_TARGET = 0.95  # issue 24: no HEAD, no whole-object copy, the manifest beside the data
BLOCKED_TARGET = 0.25  # async blocked seconds per checkpoint over sync's
ARMS = ("ours-store", "ours-store-cold", "ours-raw", "boto3", "boto3-memory", "s3fs", "s3fs-memory")
TENSORS = 4  # the state dict's float32 tensors, of equal size
MB = 10**6
STATE_FILE = "__0_0.distcp"  # the data file of a one-writer DCP checkpoint
# (payload MB, repeats, epochs, seconds of work per epoch)
FULL, QUICK = (100, 5, 5, 3.0), (20, 1, 3, 1.0)
# The loops: name -> (asynchronous, share of the epoch's work). ``async-short`` has epochs shorter
# than a commit, to show what the loop waits for when the upload cannot hide behind the epoch.
LOOPS = {"sync": (False, 1.0), "async": (True, 1.0), "async-short": (True, 1 / 3)}
MATMUL = 1024  # the loop's step: one 1024x1024 matmul, about 50 ms on one core here


def moto_server() -> None:
    """The child process: moto's S3 server on a free loopback port, printed on stdout; it stops
    when its stdin closes (the parent exited or is done)."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # it logs every request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    print(server.get_host_and_port()[1], flush=True)
    sys.stdin.read()
    server.stop()


@contextmanager
def s3_endpoint(in_process: bool) -> Iterator[str]:
    """A moto S3 server with the benchmark's bucket; the AWS variables point at it."""
    import boto3
    import s3fs

    if in_process:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        port = server.get_host_and_port()[1]
        child = None
    else:
        child = subprocess.Popen(
            [sys.executable, __file__, "--moto-server"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        line = child.stdout.readline().strip()
        if not line.isdigit():
            raise RuntimeError(f"moto's server did not start (it printed {line!r})")
        port = int(line)
    endpoint = f"http://127.0.0.1:{port}"
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        os.environ.pop(name, None)
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    s3fs.S3FileSystem.clear_instance_cache()
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    try:
        yield endpoint
    finally:
        if child is None:
            server.stop()
        else:
            assert child.stdin is not None
            child.stdin.close()
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()


def make_state(megabytes: int) -> dict[str, torch.Tensor]:
    """A state dict of ``TENSORS`` random float32 tensors, ``megabytes`` MB in all."""
    import torch

    generator = torch.Generator().manual_seed(0)
    rows = megabytes * MB // 4 // TENSORS // 1000
    return {
        f"layer{i}.weight": torch.randn(rows, 1000, generator=generator) for i in range(TENSORS)
    }


class Transfers:
    """Every arm's upload and download of the same payload, against the same bucket."""

    def __init__(self, endpoint: str, payload: bytes, work_dir: Path) -> None:
        import boto3
        import s3fs

        from prefect_ml.integrations.storage import CheckpointStore

        self.payload = payload
        self.root = f"s3://{BUCKET}/transfers"
        self.store = CheckpointStore(f"{self.root}/store")
        self.client = boto3.client("s3", endpoint_url=endpoint)
        self.s3fs = s3fs.S3FileSystem(endpoint_url=endpoint)  # the arm's own instance, defaults
        self.source = work_dir / "upload.bin"
        self.source.write_bytes(payload)  # boto3 and s3fs upload from a file: written once
        self.target = work_dir / "download.bin"

    def upload(self, arm: str) -> None:
        from prefect_ml.integrations import storage

        key = f"transfers/{arm}/state.pt"
        if arm in ("ours-store", "ours-store-cold"):
            self.store.save(1, {STATE_FILE: self.payload})
        elif arm == "ours-raw":
            storage.write_bytes(f"s3://{BUCKET}/{key}", self.payload)
        elif arm == "boto3":
            self.client.upload_file(str(self.source), BUCKET, key)
        elif arm == "boto3-memory":
            self.client.upload_fileobj(io.BytesIO(self.payload), BUCKET, key)
        elif arm == "s3fs-memory":
            fs, path = storage.filesystem(f"s3://{BUCKET}/{key}")
            fs.pipe_file(path, self.payload)
        else:
            self.s3fs.put_file(str(self.source), f"{BUCKET}/{key}")

    def download(self, arm: str) -> bytes | None:
        """The bytes (in-memory arms) or None (the others wrote ``self.target``)."""
        from prefect_ml.integrations import storage
        from prefect_ml.integrations.storage import CheckpointStore

        key = f"transfers/{arm}/state.pt"
        if arm == "ours-store":
            return self.store.load(1).files[STATE_FILE]
        if arm == "ours-store-cold":
            return CheckpointStore(self.store.root_url).load(1).files[STATE_FILE]
        if arm == "ours-raw":
            return storage.read_bytes(f"s3://{BUCKET}/{key}")
        if arm == "boto3":
            self.client.download_file(BUCKET, key, str(self.target))
        elif arm == "boto3-memory":
            buffer = io.BytesIO()
            self.client.download_fileobj(BUCKET, key, buffer)
            return buffer.getvalue()
        elif arm == "s3fs-memory":
            fs, path = storage.filesystem(f"s3://{BUCKET}/{key}")
            return fs.cat_file(path)  # type: ignore[no-any-return]
        else:
            self.s3fs.get_file(f"{BUCKET}/{key}", str(self.target))
        return None

    def check(self, downloaded: bytes | None) -> None:
        """Untimed: what came back is what went up."""
        data = self.target.read_bytes() if downloaded is None else downloaded
        if data != self.payload:
            raise AssertionError(f"downloaded {len(data)} bytes differ from the payload")

    def clean(self) -> None:
        """Untimed: drop every object, so the server holds one payload at a time."""
        listed = self.client.list_objects_v2(Bucket=BUCKET, Prefix="transfers/")
        for item in listed.get("Contents", []):
            self.client.delete_object(Bucket=BUCKET, Key=item["Key"])
        self.target.unlink(missing_ok=True)

    def measure(self, repeats: int) -> dict[str, dict[str, list[float]]]:
        """Seconds per upload and download of each arm, after one untimed round."""
        seconds: dict[str, dict[str, list[float]]] = {
            arm: {"upload": [], "download": []} for arm in ARMS
        }
        for repeat in range(-1, repeats):
            order = ARMS[max(repeat, 0) % len(ARMS) :] + ARMS[: max(repeat, 0) % len(ARMS)]
            for arm in order:
                started = time.perf_counter()
                self.upload(arm)
                uploaded = time.perf_counter()
                downloaded = self.download(arm)
                done = time.perf_counter()
                self.check(downloaded)
                self.clean()
                if repeat >= 0:
                    seconds[arm]["upload"].append(uploaded - started)
                    seconds[arm]["download"].append(done - uploaded)
            label = "warm-up" if repeat < 0 else f"repeat {repeat + 1}/{repeats}"
            print(f"  transfers {label} done", flush=True)
        return seconds


def matmul_work(seconds: float) -> int:
    """The epoch's compute: matmuls on one thread for ``seconds``; how many ran."""
    import torch

    a, b = torch.randn(MATMUL, MATMUL), torch.randn(MATMUL, MATMUL)
    count, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ b)
        count += 1
    return count


def training_loop(
    name: str, state: dict[str, torch.Tensor], epochs: int, work_seconds: float
) -> dict[str, Any]:
    """``epochs`` epochs of fixed work, each checkpointed inline or through ``EpochCommitter``
    as :data:`LOOPS` says for ``name``."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    from prefect_ml.integrations.storage import CheckpointStore
    from prefect_ml.integrations.training import (
        METRICS_FILE,
        EpochCommitter,
        StagedSnapshot,
        to_files,
    )

    asynchronous, share = LOOPS[name]
    work_seconds *= share
    store = CheckpointStore(f"s3://{BUCKET}/loop-{name}")
    committer = EpochCommitter(store) if asynchronous else None
    blocked, serialise, matmuls, epoch_seconds = [], [], [], []
    for epoch in range(1, epochs + 1):
        epoch_started = time.perf_counter()
        matmuls.append(matmul_work(work_seconds))
        next(iter(state.values()))[0, 0] += 1.0  # the weights moved
        blocked_since = time.perf_counter()
        metrics = {"train_loss": 1.0 / epoch}
        if committer is None:
            data = to_files({"model": state})
            serialise.append(time.perf_counter() - blocked_since)
            store.save(epoch, {**data, METRICS_FILE: json.dumps(metrics).encode()})
        else:
            staged = StagedSnapshot(BlockingAsyncStager().stage({"model": state}), {})
            serialise.append(time.perf_counter() - blocked_since)
            committer.submit(
                epoch, staged, metrics, epoch_started=epoch_started, blocked_since=blocked_since
            )
        now = time.perf_counter()
        blocked.append(now - blocked_since)
        epoch_seconds.append(now - epoch_started)
    drain = 0.0
    reported: list[float] = []
    if committer is not None:
        started = time.perf_counter()
        committer.close()
        drain = time.perf_counter() - started
        reported = [
            json.loads(store.read_verified(e, METRICS_FILE))["checkpoint_blocking_seconds"]
            for e in range(1, epochs + 1)
        ]
    latest = store.latest()
    if latest is None or latest.epoch != epochs:
        raise AssertionError(f"{name}: epoch {epochs} did not commit")
    return {
        "work_seconds": work_seconds,
        "blocked_seconds": blocked,
        "serialise_seconds": serialise,
        "reported_blocking_seconds": reported,  # async: EpochCommitter's own metric
        "final_wait_seconds": drain,
        "matmuls": matmuls,
        "epoch_seconds": epoch_seconds,
        # Blocked minus serialising or staging: the upload (sync) or the wait for the previous
        # commit (async).
        "upload_or_wait_median_steady": statistics.median(
            [b - s for b, s in zip(blocked, serialise, strict=True)][1:]
        ),
        "blocked_median_steady": statistics.median(blocked[1:] or blocked),
        "blocked_max_steady": max(blocked[1:] or blocked),
    }


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """Medians, throughputs and ratios from the raw seconds."""
    megabytes = report["payload_bytes"] / MB
    arms = {}
    for arm, seconds in report["transfer_seconds"].items():
        arms[arm] = {
            f"{way}_mb_s": megabytes / statistics.median(seconds[way])
            for way in ("upload", "download")
        }
        arms[arm].update(
            {f"{way}_s": statistics.median(seconds[way]) for way in ("upload", "download")}
        )
    boto3 = arms["boto3"]
    ratios = {
        f"{arm}_over_boto3_{way}": arms[arm][f"{way}_mb_s"] / boto3[f"{way}_mb_s"]
        for arm in ARMS
        for way in ("upload", "download")
    }
    loops = report["loops"]
    ratios["async_over_sync_blocked"] = (
        loops["async"]["blocked_median_steady"] / loops["sync"]["blocked_median_steady"]
    )
    store_up, store_down = (
        ratios["ours-store_over_boto3_upload"],
        ratios["ours-store_over_boto3_download"],
    )
    targets = {
        "upload": store_up >= UPLOAD_TARGET,
        "download": store_down >= DOWNLOAD_TARGET,
        "blocked": ratios["async_over_sync_blocked"] <= BLOCKED_TARGET,
    }
    return {"arms": arms, "ratios": ratios, "targets": targets}


def markdown(report: dict[str, Any]) -> str:
    summary, loops = report["summary"], report["loops"]
    arms, ratios = summary["arms"], summary["ratios"]
    lines = [
        "| arm | upload MB/s | upload / boto3 | download MB/s | download / boto3 "
        "| upload s (min-max) | download s (min-max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        raw = report["transfer_seconds"][arm]
        spread = {way: f"{min(raw[way]):.2f}-{max(raw[way]):.2f}" for way in raw}
        lines.append(
            f"| {arm} | {arms[arm]['upload_mb_s']:.0f} | {ratios[f'{arm}_over_boto3_upload']:.2f}x "
            f"| {arms[arm]['download_mb_s']:.0f} | {ratios[f'{arm}_over_boto3_download']:.2f}x "
            f"| {arms[arm]['upload_s']:.2f} ({spread['upload']}) "
            f"| {arms[arm]['download_s']:.2f} ({spread['download']}) |"
        )
    lines += [
        "",
        "| loop | blocked s per checkpoint (median, epochs 2..N) | max "
        "| of which serialise / stage s | of which upload / wait s | final wait s "
        "| matmuls per epoch |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, loop in loops.items():
        lines.append(
            f"| {name}, {loop['work_seconds']:.2g} s epochs | {loop['blocked_median_steady']:.3f} "
            f"| {loop['blocked_max_steady']:.3f} "
            f"| {statistics.median(loop['serialise_seconds'][1:]):.3f} "
            f"| {loop['upload_or_wait_median_steady']:.3f} | {loop['final_wait_seconds']:.2f} "
            f"| {statistics.median(loop['matmuls']):,.0f} |"
        )
    met = summary["targets"]
    lines += [
        "",
        f"upload: ours-store / boto3 = {ratios['ours-store_over_boto3_upload']:.2f}x "
        f"(target >= {UPLOAD_TARGET}x): {'met' if met['upload'] else 'MISSED'}",
        f"download: ours-store / boto3 = {ratios['ours-store_over_boto3_download']:.2f}x "
        f"(target >= {DOWNLOAD_TARGET}x): {'met' if met['download'] else 'MISSED'}",
        f"blocked: async / sync = {ratios['async_over_sync_blocked']:.3f}x "
        f"(target <= {BLOCKED_TARGET}x): {'met' if met['blocked'] else 'MISSED'}",
    ]
    return "\n".join(lines)


def timed(fn: Callable[[], object], repeats: int = 3) -> float:
    """Median seconds of ``fn``."""
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    megabytes, repeats, epochs, work_seconds = args.sizes
    with embedded_home() as (tmp, _settings):
        import boto3
        import moto
        import s3fs
        import torch

        from prefect_ml.integrations.training import to_files

        torch.set_num_threads(1)  # the loop's work uses one core; the other is left to S3
        state = make_state(megabytes)
        payload = to_files({"model": state})[STATE_FILE]
        load_before = os.getloadavg()
        with s3_endpoint(args.moto_in_process) as endpoint:
            print(f"moto {moto.__version__} at {endpoint}; payload {len(payload):,} bytes")
            transfers = Transfers(endpoint, payload, tmp)
            seconds = transfers.measure(repeats)
            loops = {}
            for name in LOOPS:
                loops[name] = training_loop(name, state, epochs, work_seconds)
                print(f"  loop {name} done", flush=True)
        local_costs = {
            "sha256_s": timed(lambda: hashlib.sha256(payload).hexdigest()),
            "serialise_s": timed(lambda: to_files({"model": state})),
        }
    report: dict[str, Any] = {
        "benchmark": "checkpoints",
        "quick": args.quick,
        "server": "moto in this process (thread)" if args.moto_in_process else "moto child process",
        "payload_bytes": len(payload),
        "repeats": repeats,
        "epochs": epochs,
        "work_seconds": work_seconds,
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "moto": moto.__version__,
            "boto3": boto3.__version__,
            "s3fs": s3fs.__version__,
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
        },
        "local_costs": local_costs,
        "transfer_seconds": seconds,
        "loops": loops,
    }
    report["summary"] = summarize(report)
    return report


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 20 MB, 1 repeat")
    parser.add_argument(
        "--moto-in-process",
        action="store_true",
        help="run moto's server on a thread of this process instead of a child process",
    )
    parser.add_argument("--output", type=Path, help="JSON results [results/checkpoints.json]")
    parser.add_argument("--moto-server", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    args.output = args.output or results_path("checkpoints", args.quick)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.moto_server:
        moto_server()
        return
    report = run_benchmark(args)
    save_report(report, args.output, markdown(report))


if __name__ == "__main__":
    main()
