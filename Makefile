# Two entry points: `make demo` (the main job) and `make test`; `make docs` builds the
# documentation site (docs/_build/html, warnings as errors); `make notebooks` re-runs the
# notebooks in place (full settings) so their committed outputs are current. `make data` (as
# root) installs the two real data sets from Debian's packages: Fashion-MNIST's IDX files in
# /usr/share/datasets/fashion-mnist and the Python 3.11 documentation sources (byte-level text)
# in /usr/share/doc/python3.11/html/_sources.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow notebooks install docs clean data

$(BIN)/dadjax: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test,tpu]"
	touch $(BIN)/dadjax

install: $(BIN)/dadjax

# The docs extra (Sphinx, MyST-NB, the theme), installed once per pyproject.toml change.
$(VENV)/.docs-installed: $(BIN)/dadjax
	$(BIN)/pip install --quiet -e ".[test,tpu,docs]"
	touch $(VENV)/.docs-installed

docs: $(VENV)/.docs-installed
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

demo: install
	$(BIN)/dadjax demo

test: install
	$(BIN)/python -m pytest -n 2 -q --durations=40

test-slow: install
	$(BIN)/python -m pytest -q -m slow

notebooks: install
	$(BIN)/jupyter execute --inplace --timeout=3600 notebooks/*.ipynb

data:
	@if [ "$$(id -u)" != 0 ]; then echo "make data: run as root (apt-get installs packages)"; exit 1; fi
	apt-get update
	apt-get install -y dataset-fashion-mnist python3.11-doc

clean:
	rm -rf $(VENV) demo_out runs docs/_build docs/api
