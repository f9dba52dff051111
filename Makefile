# Virtualenv in .venv; torch==2.13.0 (the CPU wheel on this machine) is installed first so that no
# requirement ever pulls a CUDA build.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install serve test test-fast demos clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'

# The OpenAI-compatible server on the bundled demo models, http://127.0.0.1:8000
serve: install
	$(BIN)/moe-serve serve

# Retrain (when runs/ has no checkpoint), export and evaluate every bundled demo model.
demos: install
	$(BIN)/python -m recipes.build_demos

# Everything CI runs, slow integration tests included.
test: install
	$(BIN)/python -m pytest -q

# Skips the tests marked slow.
test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
