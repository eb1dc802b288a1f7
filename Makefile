# Two entry points: `make demo` (the main job) and `make test`.
# Both create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test test-slow install clean

$(BIN)/dadjax: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e ".[test]"
	touch $(BIN)/dadjax

install: $(BIN)/dadjax

demo: install
	$(BIN)/dadjax demo

test: install
	$(BIN)/python -m pytest -n 2 -q

test-slow: install
	$(BIN)/python -m pytest -q -m slow

clean:
	rm -rf $(VENV) demo_out runs
