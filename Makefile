# One entry point for people and CI. `make setup` works on a fresh machine (Python, pip, apt).
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= cpu,test,math

.PHONY: setup test test-fast quickstart clean

setup:
	bash scripts/setup.sh "$(VENV)" "$(EXTRAS)"

test:
	$(PY) -m pytest -q tests

test-fast:
	$(PY) -m pytest -q -m "not integration" tests

quickstart:
	$(VENV)/bin/async-rl quickstart --out runs/quickstart

clean:
	rm -rf runs .pytest_cache
