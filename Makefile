# The two commands of the README. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
EPD := $(VENV)/bin/epd

.PHONY: setup setup-test serve test lint protos

# serve installs what serving needs; test adds the test tools (scripts/setup.sh)
setup:
	@EPD_VENV=$(VENV) bash scripts/setup.sh serve

setup-test:
	@EPD_VENV=$(VENV) bash scripts/setup.sh test

serve: setup
	$(EPD) serve $(SERVE_ARGS)

test: setup-test
	$(EPD) protos --check
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -n auto --maxprocesses 4 --durations=20 $(PYTEST_ARGS)

lint: setup-test
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

protos: setup-test
	$(EPD) protos
