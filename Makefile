# mtcfs: `make demo` and `make test` work on a fresh Debian machine as root.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: bootstrap demo test bench lint proto clean

bootstrap:
	@scripts/bootstrap.sh

demo: bootstrap
	$(VENV)/bin/mtcfs demo

test: bootstrap
	$(PY) -m ruff check mtcfs tests bench
	$(PY) -m pytest -q tests

bench: bootstrap
	$(PY) bench/run.py

lint: bootstrap
	$(PY) -m ruff check mtcfs tests bench
	$(PY) -m ruff format --check mtcfs tests bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache .hypothesis
