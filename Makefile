# Every target bootstraps .venv with nothing but python3 and pip, and installs only what
# it needs: `make demo` the library with the Haiku, NNX and Linen extras; `make test` the test
# dependencies; `make lint`, `make docs` and `make bench` the development tools (`make
# bench-newest`: the benchmarks on the newest set, beside the CPU report). One stamp
# per install set, so any order of targets works. `make test-oldest` runs the suite in a
# second environment, .venv-oldest, on the oldest supported versions (ci/oldest.txt);
# `make test-newest` in .venv-newest, on Python 3.12 with the newest (ci/newest.txt);
# `make test-py313` a smoke selection in .venv-py313, on Python 3.13.
#
# The default environment is python3's (3.11 on CI): the quick start needs nothing but
# python3 and pip, and every version in the range installs on 3.10 and 3.11.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check
PYTEST_ARGS ?=

OLDEST := .venv-oldest
NEWEST := .venv-newest
PY313  := .venv-py313

# An interpreter of Python $(1): pyenv's newest $(1).x, else python$(1) on PATH; empty if
# neither (the targets that need it then stop with the fix). PYTHON312=/path overrides.
find-python = $(or $(shell ls -d "$$(pyenv root 2>/dev/null)"/versions/$(1).*/bin/python$(1) \
	2>/dev/null | sort -V | tail -n 1),$(shell command -v python$(1) 2>/dev/null))
PYTHON312 ?= $(call find-python,3.12)
PYTHON313 ?= $(call find-python,3.13)
need-python = @test -n "$(2)" || { echo "make $(or $(MAKECMDGOALS),$@): needs Python $(1), and found none: \
	neither through pyenv ($$(pyenv root 2>/dev/null || echo "pyenv: not installed")/versions/$(1).*) \
	nor python$(1) on PATH. Install it (pyenv install $(1)), or name it: \
	make $(MAKECMDGOALS) PYTHON$(subst .,,$(1))=/path/to/python$(1)" >&2; exit 1; }

# A second test environment: interpreter $(1), folder $(2), pip options $(3) (constraints).
define test-venv
	$(1) -m venv $(2)
	$(2)/bin/python -m pip install --quiet --disable-pip-version-check $(3) -e ".[test]"
	@touch $(2)/.installed-test
endef

# pytest, where exit status 5 (no test selected: a PYTEST_ARGS file without slow tests,
# say) is not a failure; every other status is passed on.
pytest = $(1) -m pytest $(2) $(PYTEST_ARGS) || { status=$$?; [ $$status -eq 5 ] && \
	echo "(pytest: no test selected here)"; [ $$status -eq 5 ]; }

.PHONY: demo test test-slow test-next test-oldest test-newest test-py313 \
	lint bench bench-newest docs serve screenshots clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed-demo: pyproject.toml | $(PY)
	$(PIP) -e ".[haiku,nnx,linen]"
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
# both, and `make test-oldest` and `make test-newest` run both selections too. Every test
# run keeps JAX's persistent compilation cache in .jax-cache/, one folder per pytest-xdist
# worker (tests/conftest.py; JAXOVERRIDE_TEST_COMPILE_CACHE=off turns it off): it takes
# about 40% off the suite's time, and the later runs of CI reuse what the first compiled.
test: $(VENV)/.installed-test
	$(call pytest,$(PY),-n 2 -m "not slow")

test-slow: $(VENV)/.installed-test
	$(call pytest,$(PY),-n 2 -m slow)

# The parity suites again under JAX's next custom rules and remat: every one of the flags
# jax_custom_vjp3, jax_custom_jvp3 and jax_remat3 that this JAX has, on (the session's
# header names them; docs/design.md, "JAX's next flags"), on the default set and on the
# newest, whose JAX has all three.
test-next: $(VENV)/.installed-test $(NEWEST)/.installed-test
	$(call pytest,$(PY),-n 2 --jax-next=all tests/test_parity_*.py)
	$(call pytest,$(NEWEST)/bin/python,-n 2 --jax-next=all tests/test_parity_*.py)

# The constraints pin jax, Flax, Haiku and the test libraries at the lower bounds of
# pyproject.toml; everything else resolves as usual.
$(OLDEST)/.installed-test: pyproject.toml ci/oldest.txt
	$(call test-venv,$(PYTHON),$(OLDEST),-c ci/oldest.txt)

test-oldest: $(OLDEST)/.installed-test
	$(call pytest,$(OLDEST)/bin/python,-n 2)

# The newest set (ci/newest.txt: jax 0.12, Flax 0.12.12, the newest Haiku and solver
# libraries) on Python 3.12; make test's and make test-slow's selections in one run.
$(NEWEST)/.installed-test: pyproject.toml ci/newest.txt
	$(call need-python,3.12,$(PYTHON312))
	$(call test-venv,$(PYTHON312),$(NEWEST),-c ci/newest.txt)

test-newest: $(NEWEST)/.installed-test
	$(call pytest,$(NEWEST)/bin/python,-n 2)

# Python 3.13, with whatever versions pip resolves there: the library and every adapter
# install and import, and a smoke selection runs (the API parity, the registry, one file
# per adapter).
PY313_SMOKE := tests/test_parity_api.py tests/test_registry.py tests/test_plain.py \
	tests/test_haiku_rules.py tests/test_nnx_graph.py tests/test_linen_state.py \
	tests/test_dag_grad.py tests/test_debug.py

$(PY313)/.installed-test: pyproject.toml
	$(call need-python,3.13,$(PYTHON313))
	$(call test-venv,$(PYTHON313),$(PY313))

test-py313: $(PY313)/.installed-test
	$(PY313)/bin/python -c "import jaxoverride, jaxoverride_plain, jaxoverride_haiku, \
		jaxoverride_nnx, jaxoverride_linen, jaxoverride_dag, jaxoverride_debug"
	$(call pytest,$(PY313)/bin/python,-n 2 $(PY313_SMOKE))

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

# The same suites on the newest set (.venv-newest), written beside the CPU report.
bench-newest: $(NEWEST)/.installed-test
	$(NEWEST)/bin/python -m benchmarks.run --newest

clean:
	rm -rf $(VENV) $(OLDEST) $(NEWEST) $(PY313) .pytest_cache .ruff_cache .hypothesis .jax-cache site site-screenshots
