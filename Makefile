# Every target uses the project's own virtual environment at .venv/ and installs it first if needed.
PY ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

HARNESSES := pi qwen-code codex claude-code mini-swe-agent aider

# Polar's cache (harness CLIs, the tiny model) in the checkout's .cache/; outside make, an installed
# polar uses ~/.cache/polar unless POLAR_CACHE says otherwise (harness_recipes/cache.py).
export POLAR_CACHE ?= $(CURDIR)/.cache

SGLANG_WHEEL_DIR := $(POLAR_CACHE)/sglang-0.5.23/wheel
VLLM_VENV := $(POLAR_CACHE)/vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: install sysdeps harnesses vllm sglang-wheel lint test demo bench clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch first and exactly: the CPU wheel on disk, never a CUDA build.
	$(VENV)/bin/pip install -q torch==2.13.0
	# every other package at the version of constraints.txt (a frozen working install)
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[test]'
	$(VENV)/bin/pip check
	touch $(STAMP)

# The real vLLM (CPU build, requirements-vllm.txt) in its own environment, built once and kept in the cache.
vllm: $(VLLM_STAMP)

$(VLLM_STAMP): requirements-vllm.txt constraints-vllm.txt
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q -c constraints-vllm.txt -r requirements-vllm.txt
	# vLLM pulls CUDA builds of these, which break `import vllm`; a text model needs none of them.
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server"
	touch $(VLLM_STAMP)

# SGLang 0.5.23's own Python (no CPU build runs here): tests/serve/test_sglang_render.py renders
# prompts with the wheel's code and holds polar-serve's SGLang dialect to it.
sglang-wheel: install
	test -n "$$(ls $(SGLANG_WHEEL_DIR)/sglang-0.5.23-*.whl 2>/dev/null)" || $(VENV)/bin/pip download -q --no-deps sglang==0.5.23 -d $(SGLANG_WHEEL_DIR)

# System packages (chromium, bubblewrap, docker.io, npm, debootstrap) when missing; needs root to install them.
sysdeps:
	bash .ci/sysdeps.sh

# The real harness CLIs, pinned, into $(POLAR_CACHE)/harnesses/<name>/ (npm registry / PyPI).
harnesses: install sysdeps
	for h in $(HARNESSES); do $(VENV)/bin/polar-rollout install $$h || exit 1; done

# The lint rules of ruff.toml over the whole tree (a small, explicit rule set).
lint: install
	$(VENV)/bin/ruff check .

# Lint, then the whole suite, with a quiet dockerd (no bridge) for the docker runtime tests.
test: install sysdeps harnesses vllm sglang-wheel lint
	bash .ci/with-dockerd.sh $(VENV)/bin/python -m pytest -q tests

# The demo's inference server: vllm (the real vLLM, built by `make vllm`) or polar-serve (faster).
SERVER ?= vllm

demo: install sysdeps $(if $(filter vllm,$(SERVER)),vllm)
	$(VENV)/bin/python -m harness_recipes.demo --server $(SERVER)

clean:
	rm -rf $(VENV) *.egg-info
