"""The benchmarks' figures, drawn from their results (``benchmarks/results/*.json``) as SVG.

The docs build calls :func:`render_all` (docs/hooks/reference.py), so a figure on the
benchmarks page is always the committed result, never a pasted image. Run it alone to write the
files: ``python -m benchmarks.figures OUTDIR``.
"""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

# training.json's modes, as BENCHMARKS.md names them
TRAINING_MODES = {
    "a-bare": "plain PyTorch, one process",
    "b-ray": "Ray Train, a report every epoch",
    "b-lean": "Ray Train, one report",
    "c-ours": "prefect-ml train",
    "d-hooked": "prefect-ml train, a hooked model",
}


def _svg(draw: Callable[[Any], None]) -> str:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.6), layout="constrained")
    try:
        draw(axes)
        buffer = io.StringIO()
        # a fixed hash salt and no date: the same results draw the same bytes
        matplotlib.rcParams["svg.hashsalt"] = "prefect-ml"
        figure.savefig(buffer, format="svg", metadata={"Date": None})
        return buffer.getvalue()
    finally:
        plt.close(figure)


def serving(results: dict[str, Any]) -> str:
    """Requests per second against concurrent clients, one line per arm (serving.json)."""

    def draw(axes: Any) -> None:
        for arm, levels in results["arms"].items():
            clients = sorted(levels, key=int)
            axes.plot(
                [int(c) for c in clients], [levels[c]["rps"] for c in clients], "o-", label=arm
            )
        axes.set_xscale("log", base=2)
        axes.set_xlabel("concurrent clients")
        axes.set_ylabel("requests / s")
        axes.set_title(f"Serving the digits model ({results['machine']})")
        axes.legend(fontsize=7)

    return _svg(draw)


def training(results: dict[str, Any]) -> str:
    """Training samples per second by loop, per workload (training.json)."""

    def draw(axes: Any) -> None:
        workloads = list(results["workloads"])
        width = 0.8 / len(TRAINING_MODES)
        for index, (mode, label) in enumerate(TRAINING_MODES.items()):
            values = [
                results["workloads"][w]["modes"][mode]["samples_per_second"] for w in workloads
            ]
            positions = [w + index * width for w in range(len(workloads))]
            axes.bar(positions, values, width, label=label)
        axes.set_xticks([w + 0.4 - width / 2 for w in range(len(workloads))], workloads)
        axes.set_yscale("log")
        axes.set_ylabel("samples / s (log)")
        machine = results["machine"]
        axes.set_title(f"Training throughput, {machine['cpus']} CPUs (Ray modes: 2 workers)")
        axes.legend(fontsize=7)

    return _svg(draw)


def data(results: dict[str, Any]) -> str:
    """Training samples per second against dataset size, per data path (data.json)."""

    def draw(axes: Any) -> None:
        paths: dict[str, list[tuple[int, float]]] = {}
        for size, arms in results["results"].items():
            for arm, measured in arms.items():
                if isinstance(measured, dict) and "samples_per_second" in measured:
                    paths.setdefault(arm, []).append((int(size), measured["samples_per_second"]))
        for arm, points in paths.items():
            points.sort()
            axes.plot([p[0] for p in points], [p[1] for p in points], "o-", label=arm)
        axes.set_xscale("log")
        axes.set_xlabel("dataset size (MB)")
        axes.set_ylabel("samples / s")
        axes.set_title("Streamed splits against Ray Data and in-memory arrays")
        axes.legend(fontsize=7)

    return _svg(draw)


FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    "serving": serving,
    "training": training,
    "data": data,
}


def render_all(results_dir: Path) -> dict[str, str]:
    """Every figure, by name, from the results in ``results_dir``."""
    return {
        name: draw(json.loads((results_dir / f"{name}.json").read_text()))
        for name, draw in FIGURES.items()
    }


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, svg in render_all(Path(__file__).parent / "results").items():
        (out / f"{name}.svg").write_text(svg)
