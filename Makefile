# Developer shortcuts. The README's two commands are the canonical ones; these call them.
VENV ?= .venv

.PHONY: setup test test-fast lint demo clean

setup:
	./scripts/setup.sh

test:            # ruff, the suite on 3.11, then on 3.12 without torch (scripts/test.sh)
	./scripts/test.sh

test-fast:       # ruff and the 3.11 suite without the long crash and model tests
	./scripts/test.sh -m "not slow"

lint: setup
	$(VENV)/bin/ruff check .

demo:            # demo.sh runs setup itself
	./scripts/demo.sh

clean:
	-$(VENV)/bin/jpfs cluster down --dir run/cluster 2>/dev/null
	rm -rf run build *.egg-info
