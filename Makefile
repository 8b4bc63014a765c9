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
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e '.[test,report]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/tiny/run_demo.py

test: $(STAMP)
	$(BIN)/python -m pytest -q -x -p no:cacheprovider $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) examples/tiny/runs examples/tiny/model examples/tiny/export \
		examples/alpaca/runs examples/alpaca/model examples/alpaca/export examples/alpaca/schedule.short.toml \
		examples/mixed/runs examples/mixed/model
