# The README's two commands: `make demo` (the main job) and `make test` (the CPU suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-gpu bench-cpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,trl]"

setup: $(BIN)/python

demo: setup
	$(BIN)/python -m poros_fx demo

test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -p no:cacheprovider -n 2 --dist worksteal --durations=15

test-gpu: setup
	$(BIN)/python -m pytest -q -m gpu

# the host's cost per step on the CPU (benchmarks/, never in `make test`): numbers into docs/bench/cpu/
bench-cpu: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider benchmarks --benchmark-json docs/bench/cpu/host_cost.json
	$(BIN)/python benchmarks/report.py docs/bench/cpu/host_cost.json docs/bench/cpu/host_cost.md

clean:
	rm -rf $(VENV) .ci-venv poros-demo-adapter
