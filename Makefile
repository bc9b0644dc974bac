# Every target bootstraps .venv with nothing but python3 and pip.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: demo test lint bench docs clean

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e ".[dev]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/fixed_point.py

test: $(STAMP)
	$(PY) -m pytest -n 2 $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

bench: $(STAMP)
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis site
