# Two entry points: `make demo` (the main job) and `make test`; `make notebooks` re-runs the
# notebooks in place (full settings) so their committed outputs are current.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow notebooks install clean

$(BIN)/dadjax: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(BIN)/dadjax

install: $(BIN)/dadjax

demo: install
	$(BIN)/dadjax demo

test: install
	$(BIN)/python -m pytest -n 2 -q --durations=40

test-slow: install
	$(BIN)/python -m pytest -q -m slow

notebooks: install
	$(BIN)/jupyter execute --inplace --timeout=3600 notebooks/*.ipynb

clean:
	rm -rf $(VENV) demo_out runs
