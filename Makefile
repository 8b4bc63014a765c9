# Two commands on a fresh machine: `make demo`, `make test`. Everything lives in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test test-fast venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "make: installing relayer and what it runs on (torch for the CPU, DeepSpeed, transformers, datasets, pytest) into $(VENV)/: 2-3 minutes, pip says what it fetches"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on -c constraints.txt -e '.[test,report]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/tiny/run_demo.py

# The whole suite on every core (tests/run.py: pytest-xdist, then the tests marked alone one at a
# time), every failure reported at the end, the slowest tests and the wall time; PYTEST_ARGS are
# pytest's (PYTEST_ARGS="tests/shard_tools" runs one package). test-fast: the unit tests of every
# package and one real run of each kind, about 5 minutes.
test: $(STAMP)
	$(BIN)/python tests/run.py $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python tests/run.py --fast $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) examples/tiny/runs examples/tiny/model examples/tiny/export \
		examples/alpaca/runs examples/alpaca/model examples/alpaca/export examples/alpaca/schedule.short.toml \
		examples/mixed/runs examples/mixed/model
