# The two commands at the top of the README: `make demo` and `make test`.
# Both run `make setup` first; it is idempotent and takes seconds once done.
# `make test` also runs `make test-deps`: the system packages only the tests need
# (Slurm, munge, sshd), which `make setup` leaves out.
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2
TEST_WORKERS ?= 4

.PHONY: setup test-deps demo demo-bert test clean

setup:
	bash scripts/setup/setup.sh

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
test: setup test-deps
	$(VENV)/bin/python -m pytest -ra --durations=30 -n $(TEST_WORKERS) --dist loadgroup tests

# Also the `extended` tests (pytest.ini): about 10 minutes more on 2 cores.
test-extended: setup test-deps
	HVDTEST_EXTENDED=1 $(VENV)/bin/python -m pytest -ra --durations=30 -n $(TEST_WORKERS) --dist loadgroup tests

clean:
	rm -rf runs .pytest_cache
