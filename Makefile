# Virtualenv in .venv; torch==2.13.0 (the CPU wheel on this machine) is installed first so that no
# requirement ever pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test test-fast clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'

# Everything CI runs, slow integration tests included.
test: install
	$(BIN)/python -m pytest -q

# Skips the tests marked slow.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
