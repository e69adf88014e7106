"""What a batch scoring actor imports: the served version's loader, not the HTTP server."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_batch_scoring_imports_neither_fastapi_nor_ray_serve_nor_the_model_stack() -> None:
    probe = (
        "import sys\n"
        "from prefect_ml.integrations.serving import score  # loads _batch_scoring\n"
        "heavy = ('fastapi', 'starlette', 'ray.serve', 'torch', 'mlflow')\n"
        "print(' '.join(m for m in heavy if m in sys.modules) or 'none')\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "none"
