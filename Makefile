# `make train` and `make test` set everything up on first use (a .venv beside this file).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: train test bench clean-venv

$(VENV)/.base: pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $@

$(VENV)/.test: $(VENV)/.base
	$(PY) -m pip install -q -e '.[test]'
	touch $@

train: $(VENV)/.base
	$(PY) -m lm.train --config=configs/tiny.py --workdir=runs/tiny

test: $(VENV)/.test
	$(PY) -m pytest -q

bench: $(VENV)/.base
	$(PY) -m lm.bench --config=configs/tiny.py

clean-venv:
	rm -rf $(VENV)
