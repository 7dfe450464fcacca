# `make train` and `make test` set everything up on first use (a .venv from requirements.txt and
# DeepSpeed's JIT ops), then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup train test clean

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $(STAMP)

setup: $(STAMP)
	$(PY) -m app.build_ops

train: setup
	$(VENV)/bin/deepspeed app/train.py --deepspeed_config ds_configs/dp.json

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) runs
