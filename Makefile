# GGUF Studio: `make run` serves the default model, `make test` runs the suite.
# Both set up whatever is missing first: the venv, the llama-server build from
# the pinned llama.cpp release (cached in the studio home) and the default model.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# Where Debian puts chromium; the browser tests look there.
CHROMIUM := /usr/bin/chromium

.PHONY: setup venv llama model chromium audio-tools run lint test clean-venv

setup: venv llama model chromium audio-tools

venv: $(STAMP)

# Reinstall when the dependency list or a C extension changes; the stamp makes a warm run instant.
$(STAMP): pyproject.toml setup.py gguf/_skip.c studio/http/wire/_pump.c
	@command -v $(PYTHON) >/dev/null || { echo "setup: $(PYTHON) not found: apt-get install python3 python3-venv"; exit 1; }
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "setup: Python >= 3.11 is required ($(PYTHON) is older)"; exit 1; }
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV) || { echo "setup: could not create $(VENV): apt-get install python3-venv"; exit 1; }
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --upgrade pip
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -e '.[dev,model,speech]'
	@touch $(STAMP)

# Builds the pinned llama-server once (~10 min on 2 cores); later runs are a no-op. The backend is the one
# this machine's GPUs and toolkits allow (CUDA, ROCm, Metal, Vulkan, else CPU: `ggstudio build-llama --help`),
# and the studio runs that build.
llama: venv
	@$(BIN)/ggstudio build-llama

model: venv
	@$(BIN)/ggstudio fetch-model >/dev/null

# The browser tests drive Debian's Chromium through Playwright (no browser download);
# as root it is installed when missing, otherwise those tests are skipped and say why.
chromium:
	@if [ -x $(CHROMIUM) ]; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "setup: installing Debian's chromium for the browser tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
			|| echo "setup: apt-get install chromium failed: the browser tests will be skipped"; \
	else \
		echo "setup: $(CHROMIUM) is missing and only root can install it: the browser tests will be skipped (run: sudo apt-get install chromium)"; \
	fi

# The speech tests speak a real speaker reference with Debian's espeak-ng and measure WAVs with sox;
# as root they are installed when missing, otherwise the speech tests that need them are skipped and say why.
audio-tools:
	@if command -v espeak-ng >/dev/null && command -v sox >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "setup: installing Debian's espeak-ng and sox for the speech tests"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get install -y -qq espeak-ng sox >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq espeak-ng sox >/dev/null; } \
			|| echo "setup: apt-get install espeak-ng sox failed: the speech tests that need them will be skipped"; \
	else \
		echo "setup: espeak-ng or sox is missing and only root can install them: the speech tests that need them will be skipped (run: sudo apt-get install espeak-ng sox)"; \
	fi

# With LLAMA_SERVER_PATH set, that binary is used and nothing is built.
run: venv model $(if $(LLAMA_SERVER_PATH),,llama)
	$(BIN)/ggstudio serve

# ruff (lint and format) and mypy (strict on gguf/ and launcher/), as configured in pyproject.toml.
lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: setup lint
	$(BIN)/python -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
