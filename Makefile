# Developer shortcuts. The README's two commands are the canonical ones.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup test lint demo clean

setup:
	./scripts/setup.sh

test: setup
	$(PY) -m pytest -q

lint:
	$(VENV)/bin/ruff check .

demo: setup
	./scripts/demo.sh

clean:
	-$(VENV)/bin/jpfs cluster down --dir run/cluster 2>/dev/null
	rm -rf run build *.egg-info
