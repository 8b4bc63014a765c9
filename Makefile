# Two commands on a fresh machine: `make demo`, `make test`. Everything lives in .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: demo test venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	@echo "make: installing relayer and what it runs on (torch for the CPU, DeepSpeed, transformers, datasets, pytest) into $(VENV)/: 2-3 minutes, pip says what it fetches"
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --progress-bar on -c constraints.txt -e '.[test,report]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/tiny/run_demo.py

# A line per test file as it runs (the fast tests first), every failure reported at the end, and the
# slowest tests; PYTEST_ARGS="-m 'not multiprocess'" runs the fast ones only.
test: $(STAMP)
	$(BIN)/python -m pytest -p no:cacheprovider --durations=15 $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) examples/tiny/runs examples/tiny/model examples/tiny/export \
		examples/alpaca/runs examples/alpaca/model examples/alpaca/export examples/alpaca/schedule.short.toml \
		examples/mixed/runs examples/mixed/model
