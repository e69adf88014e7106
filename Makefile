# The two commands of the README: `make run` (the whole pipeline on embedded defaults) and
# `make test`. Each creates .venv and installs the project into it when missing or outdated.
VENV    := .venv
PYTHON  ?= python3
STAMP   := $(VENV)/.installed
# The exact versions CI tested (`make lock` regenerates it from pyproject.toml's ranges).
LOCK    := requirements.lock
UV      := uv==0.9.30
PYTEST_ARGS ?=
# `make test-all` runs test files side by side in TEST_WORKERS worker processes (pytest-xdist;
# each worker is a session with services of its own, tests/conftest.py); TEST_WORKERS=0 runs one
# process. `make test` is always one process. On this 2-core machine two workers took test-all
# from 70.5 to 53.5 min (2026-12-07) at load 8-27, where 5 tests failed that passed alone; those
# five now wait on their event instead of a deadline, or set their table's width (3622380, cdc716b,
# 0e8147c). test-all with two workers has not been timed again since.
TEST_WORKERS ?= 2
XDIST   = -n $(TEST_WORKERS) --dist loadgroup
# `make bench BENCH_ARGS=--quick`: every benchmark's smoke run (results/*.quick.json, not committed)
BENCH_ARGS ?=

.PHONY: install run test test-all lock bench chaos lint clean postgresql chromium docs docs-serve

# A changed lock (or pyproject.toml) gets a new virtualenv, never an upgrade in place: what a
# fresh clone installs is what CI tested, and a missing install step fails here first.
$(STAMP): $(LOCK) pyproject.toml
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	# torch pinned in the install step (see shared FIELD_NOTES): on these machines pip takes the
	# CPU build that lies on disk; an unpinned torch would pull a multi-GB CUDA build. uv then
	# installs the lock (torch already satisfied) several times faster than pip.
	$(VENV)/bin/pip install --quiet $(UV) torch==2.13.0
	$(VENV)/bin/uv pip install --quiet --python $(VENV)/bin/python -r $(LOCK)
	$(VENV)/bin/uv pip install --quiet --python $(VENV)/bin/python --no-deps -e .
	touch $(STAMP)

# Resolve pyproject.toml's ranges afresh (pip, which finds the CPU torch on disk) into the lock.
lock:
	rm -rf build/lock-venv
	$(PYTHON) -m venv build/lock-venv
	build/lock-venv/bin/pip install --quiet torch==2.13.0
	build/lock-venv/bin/pip install --quiet -e '.[test]'
	{ sed -n '1,2p' $(LOCK); build/lock-venv/bin/pip freeze --all --exclude-editable; } > $(LOCK).new
	mv $(LOCK).new $(LOCK)
	rm -rf build/lock-venv

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/prefect-ml run

# Debian's PostgreSQL server, whatever its version (/usr/lib/postgresql/<version>/bin): the tests
# and the study-storage benchmark start clusters of their own on loopback (tests/postgres.py).
postgresql:
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		(apt-get update -qq && apt-get install -y -qq --no-install-recommends postgresql)

# The browser test drives the Prefect UI in Debian's Chromium (Playwright's own download is not
# reachable from these machines). Without recommends (systemd, udev, a terminal emulator), with
# the one recommend it needs: a font, so that text has a size to click.
chromium:
	test -x /usr/bin/chromium || (apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium fonts-liberation)

# The README's test command, what CI runs: every unit and contract test and one end-to-end test
# per way a user enters the product (tests/tiers.py). About 20 minutes on 2 cores.
test: $(STAMP) postgresql chromium
	$(VENV)/bin/python -m pytest -m "not full" $(PYTEST_ARGS)

# Everything, the full tier's end-to-end scenarios included (chaos runs stay in `make chaos`).
test-all: $(STAMP) postgresql chromium
	$(VENV)/bin/python -m pytest $(XDIST) $(PYTEST_ARGS)

bench: $(STAMP) postgresql
	$(VENV)/bin/python benchmarks/training.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/sweep.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/study_storage.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/cluster.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/checkpoints.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/sharded_checkpoints.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/data.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/predict.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/precision.py $(BENCH_ARGS)
	$(VENV)/bin/python benchmarks/startup.py $(BENCH_ARGS)
	# The serving benchmark's load generator is wrk (Debian package).
	command -v wrk >/dev/null || apt-get install -y -qq --no-install-recommends wrk
	$(VENV)/bin/python benchmarks/serving.py $(BENCH_ARGS)

# Kill the CLI, a checkpoint writer and Ray workers at random moments, rerun, check the invariants
# (RELIABILITY.md). About 3 hours on 2 cores; CHAOS_ARGS="--kills 5 --seed N" for a short one.
CHAOS_ARGS ?= --kills 50
chaos: $(STAMP)
	$(VENV)/bin/python benchmarks/chaos.py $(CHAOS_ARGS)

# ruff, mypy, and the import contracts of pyproject.toml (layers, no cycles, who imports each
# external system).
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy prefect_ml
	$(VENV)/bin/lint-imports --no-cache

# The documentation site (mkdocs.yml, docs/), built strictly: a broken link or anchor, a missing
# reference or a public symbol without a docstring fails. The tests run the same build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/python -m mkdocs build --strict

# The site at http://127.0.0.1:8001 (8000 is prefect-ml serve's), rebuilt as pages, code and
# included files change.
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/python -m mkdocs serve --dev-addr 127.0.0.1:8001 \
		--watch flows --watch tasks --watch integrations --watch benchmarks/results

clean:
	rm -rf .prefect-ml
