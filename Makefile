# Every target makes its own virtual environment in .venv and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test slow bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)  ## the main job (see README)
	$(VENV)/bin/croupier demo

test: $(STAMP)  ## the default test suite
	$(PY) -m pytest -q

slow: $(STAMP)  ## long property and chaos runs
	$(PY) -m pytest -q -m slow

bench: $(STAMP)  ## full benchmarks
	$(PY) benchmarks/order_bench.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
