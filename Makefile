# The two commands at the top of the README: `make demo` and `make test`.
# Both run `make setup` first; it is idempotent and takes seconds once done.
# `make test` also runs `make test-deps`: the system packages only the tests need
# (Slurm, munge, sshd), which `make setup` leaves out.
VENV ?= .venv
PY := $(VENV)/bin/python
NP ?= 2

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

test: setup test-deps
	$(VENV)/bin/python -m pytest -ra --durations=30 tests

clean:
	rm -rf runs .pytest_cache
