# Every target bootstraps .venv with nothing but python3 and pip, and installs only what
# it needs: `make demo` the library with the Haiku and NNX extras; `make test` the test
# dependencies; `make lint`, `make docs` and `make bench` the development tools. One stamp
# per install set, so any order of targets works. `make test-oldest` runs the suite in a
# second environment, .venv-oldest, on the oldest supported versions (ci/oldest.txt).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
PYTEST_ARGS ?=

OLDEST := .venv-oldest

.PHONY: demo test test-slow test-next test-oldest lint bench docs serve screenshots clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-demo: pyproject.toml | $(PY)
	$(PIP) -e ".[haiku,nnx]"
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(PY)
	$(PIP) -e ".[test]"
	@touch $@

$(VENV)/.installed-dev: pyproject.toml | $(PY)
	$(PIP) -e ".[dev]"
	@touch $@

demo: $(VENV)/.installed-demo
	$(PY) examples/fixed_point.py

# `make test` runs everything but the tests marked slow (fresh interpreters that import the
# solver libraries, long runs, the wheel, multi-host); `make test-slow` runs those. CI runs
# both, and `make test-oldest` runs the whole suite.
test: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 -m slow $(PYTEST_ARGS)

# The parity suites again under JAX's next custom rules and remat: every one of the flags
# jax_custom_vjp3, jax_custom_jvp3 and jax_remat3 that this JAX has, on (the session's
# header names them; docs/design.md, "JAX's next flags").
test-next: $(VENV)/.installed-test
	$(PY) -m pytest -n 2 --jax-next=all $(PYTEST_ARGS) tests/test_parity_*.py

# The constraints pin jax, Flax, Haiku and the test libraries at the lower bounds of
# pyproject.toml; everything else resolves as usual.
$(OLDEST)/.installed-test: pyproject.toml ci/oldest.txt
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST)/bin/python -m pip install --quiet --disable-pip-version-check \
		-c ci/oldest.txt -e ".[test]"
	@touch $@

test-oldest: $(OLDEST)/.installed-test
	$(OLDEST)/bin/python -m pytest -n 2 $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/pyright

docs: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# The built site links page to page as files, so it also opens from disk (site/index.html).
serve: $(VENV)/.installed-test
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

# The built site at 1280 px in headless Chromium (not part of `make test`): screenshots
# into site-screenshots/ and a layout check of every page (clipped code blocks, inline
# code broken mid-identifier in tables, the sidebar title over its first entry, images
# wider than the column). Needs Chromium: `apt-get install chromium`, or CHROMIUM=/path.
screenshots: docs
	$(PY) ci/screenshots.py site site-screenshots

bench: $(VENV)/.installed-test
	$(PY) -m benchmarks.run

clean:
	rm -rf $(VENV) $(OLDEST) .pytest_cache .ruff_cache .hypothesis site site-screenshots
