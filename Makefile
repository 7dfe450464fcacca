# `make train` and `make test` set everything up on first use (a .venv from requirements.txt and
# DeepSpeed's JIT ops), then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
OPS := $(VENV)/.ops-built

.PHONY: setup train test clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

# DeepSpeed compiles its ops on first use (about a minute each); do it once here, not in a run.
$(OPS): $(STAMP)
	$(PY) -m app.build_ops
	touch $(OPS)

setup: $(OPS)

train: setup
	$(VENV)/bin/deepspeed app/train.py --deepspeed_config ds_configs/dp.json

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs
