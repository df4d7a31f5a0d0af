# The README's two commands. Each creates a fresh virtualenv and installs
# attnlab into it from this checkout, so they work on a new machine.
PYTHON ?= python3
VENV ?= .venv
PYTEST_ARGS ?= -n 2 --dist worksteal

.PHONY: demo test lint

demo:
	rm -rf $(VENV) && $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e .
	bash tools/demo.sh $(VENV)

test:
	rm -rf $(VENV) && $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	# torch 2.13.0 (CPU build, on this machine's disk) + transformers: the HF parity tests
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test,hf,tokenizers]'
	$(VENV)/bin/ruff check attnlab tests tools experiments
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint:
	$(VENV)/bin/ruff check attnlab tests tools experiments
