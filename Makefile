# Two commands set up everything on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: install serve test test-fast bench proto clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The daemon on embedded defaults: 127.0.0.1:50051, data dir ./expstore-data.
serve: $(STAMP)
	$(BIN)/expstore-server $(ARGS)

# The whole suite, slow tests included (tests/unit/test_docs.py checks the generated stubs).
test: $(STAMP)
	$(BIN)/python -m pytest -q $(ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(ARGS)

bench: $(STAMP)
	$(BIN)/python -m benchmarks.run $(ARGS)

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
