# The two commands at the top of the README: `make demo` and `make test`.
# Both run `make setup` first; it is idempotent and takes seconds once done.
# `make test` also runs `make test-deps`: the system packages only the tests need
# (Slurm, munge, sshd), which `make setup` leaves out.
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
TEST_WORKERS ?= 4

.PHONY: setup wheelhouse test-deps demo demo-bert test test-scale test-horovod clean

setup:
	bash scripts/setup/setup.sh

# Where there is network: every package `make setup` installs, into WHEELHOUSE (default
# ./wheelhouse); then `make setup WHEELHOUSE=DIR` installs from it with none (docs/setup.md).
wheelhouse:
	bash scripts/setup/setup.sh --make-wheelhouse

test-deps:
	bash scripts/setup/test-deps.sh

# The main job: the CNN trainer on 2 processes, on its embedded default data.
demo: setup
	$(VENV)/bin/horovodrun -np $(NP) $(PY) scripts/train_cnn.py --output-dir runs/demo-cnn --no-resume

# BERT: prepare the embedded default corpus, then pretrain the tiny model.
demo-bert: setup
	$(PY) scripts/prepare_bert_data.py --output-dir runs/demo-bert-data
	$(VENV)/bin/horovodrun -np $(NP) $(PY) scripts/pretrain_bert.py --data runs/demo-bert-data \
	    --model tiny --output-dir runs/demo-bert --no-resume

# The suite mostly waits (launchers, timeouts, Slurm): TEST_WORKERS tests run side by
# side (pytest-xdist); tests that share a cluster, the two hosts or a module's data
# stay on one worker (tests/conftest.py). TEST_WORKERS=0 runs them one at a time.
# Two tiers (docs/testing.md): `make test` proves every mechanism once at its smallest
# real scale (what CI runs, 18 to 34 minutes on 2 cores by machine: docs/testing.md); `make test-scale` runs only
# the larger forms (16 and 32 ranks on four hosts and four Slurm nodes, the other
# launchers of each fault, the 2.4 GB checkpoint). Each prints what its tests cost in CPU.
PYTEST := $(VENV)/bin/python -m pytest -ra --durations=30 -n $(TEST_WORKERS) --dist loadgroup tests

test: setup test-deps
	$(PYTEST)

test-scale: setup test-deps
	HVDTEST_TIER=scale $(PYTEST)

# Horovod's own suites (v0.28.1: the elastic driver, discovery, elastic torch, test_torch.py under
# Gloo and MPI) against the Horovod that make setup built with the patch series; every failure
# is one expected-failures.txt explains (docs/horovod.md). Also run by make test-scale.
test-horovod: setup
	$(PY) tools/horovod_upstream_tests.py

clean:
	rm -rf runs .pytest_cache
