# gemma-rust-operator: every set-up step lives here, so a fresh machine needs
# only `make demo` or `make test`.
#
# Slow downloads and builds are cached outside the checkout, keyed by version:
#   $(CACHE)/uv-$(UV_VERSION)    the uv installer itself
#   $(CACHE)/uv-cache            wheels (torch is ~3 GB; a warm install is hard links)
#   $(CACHE)/cargo/<key>         the engine's cargo target dir, per torch and python
#   $(CACHE)/k8s-<version>       local control plane binaries and the endpoint picker (tests/cluster/)
#   $(CACHE)/crds/<module>-<ver> third-party CRDs the tests install (KEDA, the inference extension)
#   $(CACHE)/chat-templates      Google's Gemma 4 chat templates, from a pinned llama-cpp-python sdist
#   $(CACHE)/base-images         Debian root filesystems for local stand-ins of the images' bases
#                                (tests/images/base_images.py), keyed by recipe
#   $(CACHE)/inductor            Inductor's and AOTAutograd's caches of compiled decode steps
#                                (keyed by graph and torch version), shared by every test and bench

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

CACHE      ?= $(HOME)/.cache/gemma-rust-operator
UV_VERSION := 0.13.9
PYTHON     ?= python3.11
TORCH_VERSION := $(shell sed -n 's/^torch==//p' requirements/dev.lock)
UV         := $(CACHE)/uv-$(UV_VERSION)/bin/uv
VENV       := .venv
PY         := $(VENV)/bin/python
export UV_CACHE_DIR := $(CACHE)/uv-cache
export UV_LINK_MODE := hardlink
export CARGO_TARGET_DIR := $(CACHE)/cargo/torch-$(TORCH_VERSION)-$(PYTHON)
export VIRTUAL_ENV := $(CURDIR)/$(VENV)
export GEMMA_CACHE := $(CACHE)
export TORCHINDUCTOR_CACHE_DIR ?= $(CACHE)/inductor

# Stamps make a second run with nothing changed skip set-up.
PY_STAMP     := $(VENV)/.deps-stamp
ENGINE_STAMP := $(VENV)/.engine-stamp
RUST_SOURCES := $(shell find rust -type f \( -name '*.rs' -o -name '*.cpp' -o -name '*.h' -o -name '*.toml' -o -name '*.pyi' \) 2>/dev/null)

# Container images (`make images`). Tags: $(REGISTRY)/gemma-rust-operator and $(REGISTRY)/gemma-server at
# the distributions' version.
REGISTRY     ?= gemma-rust-operator
IMAGE_TAG    := $(shell sed -n 's/^version = "\(.*\)"/\1/p' operator/pyproject.toml)
DOCKER_BUILD_FLAGS ?= --network host
# Runs its command with a Docker engine that builds with BuildKit ($$DOCKER): the one that answers, or a
# dockerd started for the command and stopped after it (tests/images/docker_engine.sh).
WITH_DOCKER  := bash tests/images/docker_engine.sh

.PHONY: help setup engine engine-wheel rust-check chat-templates test test-fast demo bench bench-architectures bench-server bench-operator bench-agent bench-compiled bench-compile-stage bench-fuzz bench-soak k8s k8s-crds lock crds clean images base-images

help:
	@echo "make demo   build everything and run the demo (see README)"
	@echo "make test   build everything and run every test"
	@echo "make bench  engine benchmark (Rust vs Transformers)"

$(UV):
	$(PYTHON) -m venv $(CACHE)/uv-$(UV_VERSION)
	$(CACHE)/uv-$(UV_VERSION)/bin/pip install --quiet uv==$(UV_VERSION)

$(PY_STAMP): requirements/dev.lock operator/pyproject.toml server/pyproject.toml | $(UV)
	[ -x $(PY) ] || $(UV) venv --quiet --python $(PYTHON) $(VENV)
	$(UV) pip sync --quiet requirements/dev.lock
	$(UV) pip install --quiet --no-deps -e operator -e server
	touch $@

# maturin builds rust/ in release mode against the torch in .venv; cargo's
# target dir is cached per torch version, so a rebuild is incremental.
$(ENGINE_STAMP): $(PY_STAMP) $(RUST_SOURCES)
	PATH=$(CURDIR)/$(VENV)/bin:$(dir $(UV)):$$PATH maturin develop --uv --quiet --release --manifest-path rust/Cargo.toml
	touch $@

setup: $(PY_STAMP) $(ENGINE_STAMP)
engine: $(ENGINE_STAMP)

# A wheel of the engine for another torch and Python than .venv's (a GPU host's: the module is built against
# the torch it will load), into dist/: `make engine-wheel WHEEL_TORCH=2.11.0 WHEEL_PYTHON=/path/to/python3.12`
# (that Python must be on this machine: uv does not download one here). Built in an environment of its own
# holding that torch, with the CUDA compiler's crt/ headers (nvidia-cuda-crt, matching the torch's CUDA) so the
# build has CUDA graphs.
WHEEL_TORCH    ?= $(TORCH_VERSION)
WHEEL_PYTHON   ?= $(PYTHON)
WHEEL_CUDA_CRT ?= 13.0.*
WHEEL_PYVER     = $(shell $(WHEEL_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
WHEEL_ENV       = $(CACHE)/wheel-env/torch-$(WHEEL_TORCH)-py$(WHEEL_PYVER)
engine-wheel: | $(UV)
	[ -x $(WHEEL_ENV)/bin/python ] || $(UV) venv --quiet --python $(WHEEL_PYTHON) $(WHEEL_ENV)
	$(UV) pip install --quiet --python $(WHEEL_ENV)/bin/python torch==$(WHEEL_TORCH) \
	  "nvidia-cuda-crt==$(WHEEL_CUDA_CRT)" $$(grep '^maturin==' requirements/dev.lock)
	# build.rs writes python/gemma_engine/_build.py (the torch a build needs): touched, it runs again and writes
	# this torch's into the wheel; .venv's is put back after.
	keep=$$(mktemp); cp rust/python/gemma_engine/_build.py $$keep 2>/dev/null || :; status=0; touch rust/build.rs; \
	VIRTUAL_ENV=$(WHEEL_ENV) PYO3_PYTHON=$(WHEEL_ENV)/bin/python \
	  CARGO_TARGET_DIR=$(CACHE)/cargo/torch-$(WHEEL_TORCH)-python$(WHEEL_PYVER) \
	  $(WHEEL_ENV)/bin/maturin build --quiet --release --auditwheel skip --manifest-path rust/Cargo.toml \
	  --interpreter $(WHEEL_ENV)/bin/python --out dist || status=$$?; \
	if [ -s $$keep ]; then cp $$keep rust/python/gemma_engine/_build.py; fi; rm -f $$keep; exit $$status

# The crate's own checks: clippy with warnings as errors (the crate's internals are private, so an unused
# shim entry, wrapper or field is dead code that fails here) and its Rust unit tests.
rust-check: $(PY_STAMP)
	cd rust && PATH=$(CURDIR)/$(VENV)/bin:$$PATH cargo clippy --release --all-targets --quiet -- -D warnings
	cd rust && PATH=$(CURDIR)/$(VENV)/bin:$$PATH cargo test --release --quiet

# Every test, slow, cluster and GPU markers included (GPU tests skip with a
# reason on a machine without one; nothing else skips). The control plane
# binaries are built (and the third-party CRDs fetched) here, once, rather than inside a test fixture, so the
# first build (many minutes) is not cut short by the per-test timeout: tests/run_all.sh builds them in the
# background while the tests that need no cluster run, then runs the cluster tests. The
# image tests need Docker: pytest runs with a Docker engine (started here
# when none answers, and stopped after), and fails naming it when there is none.
test: setup k8s-crds chat-templates rust-check
	$(WITH_DOCKER) bash tests/run_all.sh $(PY)

# The quick loop while developing: no slow and no cluster tests.
test-fast: setup chat-templates
	$(PY) -m pytest tests -m "not slow and not cluster"

demo: setup
	$(PY) -m bench.demo

bench: setup
	$(PY) -m bench.engine

bench-architectures: setup
	$(PY) -m bench.architectures

bench-server: setup
	$(PY) -m bench.server

bench-operator: setup
	$(PY) -m bench.operator

# Prefix caching on an agent session through the server, on Google's Gemma 4 template (cached and not).
bench-agent: setup chat-templates
	$(PY) -m bench.agent_session

# The compiled decode step against eager, and the read bound (README "The compiled decode step").
bench-compiled: setup
	$(PY) -m bench.compiled

# The compile boot stage with an empty Inductor cache and on a restart that loads it, each graph's seconds.
bench-compile-stage: setup
	$(PY) -m bench.compile_stage

# The long run of requests generated from the server's OpenAPI document (tests/server/test_openapi.py is the
# short one), and minutes of concurrent streaming load with the server's invariants checked afterwards.
bench-fuzz: setup
	$(PY) -m bench.fuzz

bench-soak: setup
	$(PY) -m bench.soak

# Both images, built from the repository root (README, "Deploying on GKE", says how to push them).
images:
	$(WITH_DOCKER) bash -c '$$DOCKER build $(DOCKER_BUILD_FLAGS) -f images/Dockerfile.operator -t $(REGISTRY)/gemma-rust-operator:$(IMAGE_TAG) . \
	  && $$DOCKER build $(DOCKER_BUILD_FLAGS) -f images/Dockerfile.server -t $(REGISTRY)/gemma-server:$(IMAGE_TAG) .'

# The images' bases where no registry answers: local stand-ins built from Debian's packages
# (tests/images/base_images.py; the image tests do this themselves).
base-images:
	$(WITH_DOCKER) $(PYTHON) -m tests.images.base_images

# Google's Gemma 4 chat templates, which tests render through (tests/fetch_chat_templates.py): taken from
# llama-cpp-python's source distribution (pinned by version and sha256), which vendors llama.cpp's copies.
chat-templates: $(PY_STAMP)
	$(PY) -m tests.fetch_chat_templates

# Local control plane binaries, helm and the inference extension's endpoint picker, built once from the Go
# module proxy into $(CACHE)/k8s-<version>/ (the cluster fixture does this on first use).
k8s:
	bash tests/cluster/build_binaries.sh

# KEDA's ScaledObject and the Gateway API inference extension's InferencePool (and the InferenceObjective and
# InferenceModelRewrite its picker watches) CRDs, from their Go modules
# through the Go module proxy, into $(CACHE)/crds/ (tests/cluster/crds.py installs them in tests).
k8s-crds:
	bash tests/cluster/fetch_crds.sh

# Regenerate the CRD from the operator's pydantic spec and its admission policy (gemma_operator.admission),
# and the chart's copies: the CRD in its crds/, the policy in files/ (a template includes it; helm's crds/
# takes CustomResourceDefinitions only).
crds: $(PY_STAMP)
	$(PY) -m gemma_operator.crd > crds/gemmarustservers.gemmarust.dev.yaml
	$(PY) -m gemma_operator.admission > crds/gemmarustservers.gemmarust.dev.admission.yaml
	cp crds/gemmarustservers.gemmarust.dev.yaml charts/gemma-rust-operator/crds/
	cp crds/gemmarustservers.gemmarust.dev.admission.yaml charts/gemma-rust-operator/files/

# Regenerate the pinned lock from requirements/dev.in.
lock: | $(UV)
	$(UV) pip compile --quiet --python-version 3.11 requirements/dev.in -o requirements/dev.lock

clean:
	rm -rf $(VENV)
