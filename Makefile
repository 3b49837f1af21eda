# Caller Memory — the two commands a newcomer needs are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PORT   ?= 8080
BIN    := $(VENV)/bin

.PHONY: install install-test run test fuzz bench lint format redis-server chromium clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# The service and its command line, editable, in a local virtualenv.
install: $(BIN)/python
	$(BIN)/pip install --quiet -e .

install-test: $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'

# Start the service on the embedded SQLite store (./caller-memory.db), port $(PORT).
run: install
	@PORT=$(PORT) VENV=$(VENV) ./scripts/run-dev

# The tests need a real redis-server (Debian's package); install it when it is missing.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || ./scripts/install-redis

# The browser tests drive Debian's chromium (headless); install it when it is missing.
chromium:
	@test -x /usr/bin/chromium || ./scripts/install-chromium

lint: install-test
	$(BIN)/ruff check service sdk tests examples bench
	$(BIN)/ruff format --check service sdk tests examples bench
	$(BIN)/mypy service sdk

test: install-test redis-server chromium lint
	$(BIN)/pytest -q

# A longer schemathesis campaign against a live service (tests/fuzz): 500 fuzzed cases per operation and 2000
# call sequences per run, new ones each time, no time limit. CALLER_MEMORY_FUZZ_SEED=<the seed it printed>
# replays a run.
fuzz: install-test redis-server
	CALLER_MEMORY_FUZZ_EXAMPLES=$${CALLER_MEMORY_FUZZ_EXAMPLES:-500} $(BIN)/pytest -q tests/fuzz

# Benchmarks of issue 7 against a hand-written baseline, side by side (about 12 minutes; needs
# redis-server and redis-benchmark). `$(BIN)/python bench/run.py --quick` takes about 2.5 minutes. Results in
# bench/results/perf.json and bench/results/profile-*; see bench/README.md.
bench: install-test redis-server
	$(BIN)/pip install --quiet -r bench/requirements.txt
	$(BIN)/python bench/run.py

format: install-test
	$(BIN)/ruff format service sdk tests examples bench
	$(BIN)/ruff check --fix service sdk tests examples bench

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
