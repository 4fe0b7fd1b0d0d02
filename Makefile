# Two commands on a fresh machine: `make demo` and `make test`. Both run `setup` first (idempotent).
PY := .venv/bin/python
PYTEST := .venv/bin/pytest

.PHONY: setup demo test test-unit test-integration lint bench clean

setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m router_sidecar demo $(DEMO_ARGS)

test: setup
	$(PYTEST) tests -q $(PYTEST_ARGS)

test-unit: setup
	$(PYTEST) tests/unit -q $(PYTEST_ARGS)

test-integration: setup
	$(PYTEST) tests/integration tests/fault -q $(PYTEST_ARGS)

lint: setup
	.venv/bin/ruff check router_sidecar tests bench
	.venv/bin/ruff format --check router_sidecar tests bench

bench: setup
	$(PY) bench/stream_overhead.py $(BENCH_ARGS)

clean:
	rm -rf .venv .tools .pytest_cache
