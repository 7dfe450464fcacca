# `make train` and `make test` set everything up on first use (a .venv from requirements.txt and
# requirements-trackers.txt, and DeepSpeed's JIT ops), then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPS := $(VENV)/.ops-built

.PHONY: setup train test test-fast cluster-packages wheelhouse clean

# The trackers (W&B, MLflow) install with the pins of requirements.txt held, which the wheelhouse packs alone.
$(STAMP): requirements.txt requirements-trackers.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	$(PY) -m pip install --quiet -r requirements-trackers.txt -c requirements.txt
	touch $(STAMP)

# DeepSpeed compiles its ops on first use (about a minute each); do it once here, not in a run.
$(OPS): $(STAMP) app/tools/build_ops.py
	$(PY) -m app.tools.build_ops
	touch $(OPS)

setup: $(OPS)

train: setup
	$(VENV)/bin/deepspeed --quiet app/train.py --deepspeed_config ds_configs/dp.json

# The whole suite; the multi-node tests need pdsh, sshd, OpenMPI, Slurm and munge, the NVMe tests libaio: installed
# when missing as root, skipped (saying how to install them) for another user.
test: setup cluster-packages
	$(PY) -m pytest -q --durations=15 tests

cluster-packages:
	bash scripts/cluster-packages.sh

# The fast tier: tests/unit, no subprocess, launcher, spawned ranks nor DeepSpeed engine (about ten minutes).
test-fast: setup
	$(PY) -m pytest -q tests/unit

# For machines without internet: wheels of requirements.txt and all it needs for Python $(WHEEL_PYTHON) on
# manylinux x86_64, less torch, torchvision, triton and the CUDA libraries. Needs internet, not the .venv. pip
# runs under make's PYTHON=... when given, else python$(WHEEL_PYTHON) if there is one, else python3.
# On the machine: python3 scripts/install_missing.py $(WHEELHOUSE) [--target DIR]
WHEELHOUSE ?= wheelhouse
WHEEL_PYTHON ?= 3.12
wheelhouse:
	bash scripts/wheelhouse.sh $(WHEELHOUSE) $(WHEEL_PYTHON)

clean:
	rm -rf $(VENV) runs
