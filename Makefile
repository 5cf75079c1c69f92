# The two commands of the README. Both install what they need first.
VENV ?= .venv
PY := $(VENV)/bin/python
EPD := $(VENV)/bin/epd

.PHONY: setup serve test lint protos

setup:
	@bash scripts/setup.sh

serve: setup
	$(EPD) serve $(SERVE_ARGS)

test: setup
	$(EPD) protos --check
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q --durations=20 $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

protos: setup
	$(EPD) protos
