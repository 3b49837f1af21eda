# Caller Memory — the two commands a newcomer needs are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PORT   ?= 8080
BIN    := $(VENV)/bin

.PHONY: install install-test run test test-floors fuzz bench lint format redis-server wrk chromium clean

# setuptools maps caller_memory.service -> service/ and caller_memory.sdk -> sdk/ (package-dir), a layout that a
# static .pth cannot express, so its editable install uses an import hook and says so in a boxed warning asking
# to beware of a folder named like the package in the working directory. There is none here (no caller_memory/
# folder: that is why the mapping exists), so the notice is silenced; the mapping itself is what we want.
QUIET_EDITABLE := PYTHONWARNINGS="ignore:Editable installation"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# uv installs into the virtualenv (the test extra with the two voice frameworks: about 150 packages, ~9 s from
# PyPI where pip takes ~60 s); pip stays in it for anything else.
$(BIN)/uv: | $(BIN)/python
	$(BIN)/pip install --quiet uv

UV_INSTALL := $(QUIET_EDITABLE) $(BIN)/uv pip install --quiet --python $(BIN)/python

# The service and its command line, editable, in a local virtualenv. Installed again only when pyproject.toml
# changes (the stamps live in the virtualenv: deleting it starts afresh); code edits need no reinstall.
install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml | $(BIN)/uv
	$(UV_INSTALL) -e .
	@touch $@

$(VENV)/.installed-test: pyproject.toml | $(BIN)/uv
	$(UV_INSTALL) -e '.[test]'
	@touch $@ $(VENV)/.installed

# Start the service on the embedded SQLite store (./caller-memory.db), port $(PORT).
run: install
	@PORT=$(PORT) VENV=$(VENV) ./scripts/run-dev

# The tests need a real redis-server (Debian's package); install it when it is missing.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || ./scripts/install-redis

# `make bench` also measures the reads with wrk (Debian's package); install it when it is missing.
wrk:
	@command -v wrk >/dev/null 2>&1 || ./scripts/install-wrk

# The browser tests drive Debian's chromium (headless); install it when it is missing.
chromium:
	@test -x /usr/bin/chromium || ./scripts/install-chromium

# import-linter checks the layering of the engineering guide (contracts in pyproject.toml, [tool.importlinter]).
# The tests are type-checked too (a relaxed override in pyproject.toml): mypy cannot follow the editable
# install's import hook, so it finds caller_memory through a folder of two symlinks (git-ignored). No module of
# service/ or sdk/ may pass 600 lines (scripts/structure.py sizes).
TYPECHECK := .typecheck/caller_memory

lint: install-test $(TYPECHECK)/service $(TYPECHECK)/sdk
	$(BIN)/ruff check service sdk tests examples bench scripts
	$(BIN)/ruff format --check service sdk tests examples bench scripts
	$(BIN)/mypy service sdk
	MYPYPATH=.typecheck $(BIN)/mypy tests
	$(BIN)/lint-imports
	$(BIN)/python scripts/structure.py sizes

$(TYPECHECK)/%:
	mkdir -p $(TYPECHECK)
	ln -sfn ../../$* $@

# The frameworks' drop-ins are tested each in a pytest process of its own (see norecursedirs in pyproject.toml),
# while the floors' environment is built and their suite runs beside them (its output is shown when it ends):
# about 40 s less than one after the other.
FRAMEWORK_TESTS := tests/frameworks/test_pipecat.py tests/frameworks/test_livekit.py
# The main suite runs in this many pytest-xdist worker processes (each starts its own Redis servers);
# `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2

test: install-test redis-server chromium lint
	$(BIN)/pytest -q -n $(TEST_WORKERS)
	@log=$$(mktemp); $(MAKE) --no-print-directory test-floors > $$log 2>&1 & floors=$$!; \
	failed=0; for t in $(FRAMEWORK_TESTS); do echo "$$t:"; $(BIN)/pytest -q -p no:cacheprovider $$t || failed=1; done; \
	wait $$floors; floors_status=$$?; echo "make test-floors:"; cat $$log; rm -f $$log; \
	test $$failed = 0 && test $$floors_status = 0

# The declared floors are promises: the lowest version that pyproject.toml allows of every runtime dependency
# (`name==floor`, written by scripts/floors.py) in its own virtualenv, the project installed without
# dependencies over them, and the part of the suite that exercises them: the storage contract suite on SQLite,
# Redis and Redis Cluster, a cluster failover (redis-py's slot-map internals), the HTTP API on Redis and its
# guarded server (aiohttp's RequestHandler), the SDK client. (The HTTP API on the cluster runs the same aiohttp
# and pydantic code as on Redis, and the cluster client is covered by the storage suite: left out for time.) Test tools resolve normally. Left out for time: the SDK's
# kill-and-restart tests, the 20,000-connection flood, and the SQLite variants of the HTTP and SDK tests (their
# Redis variants run the same aiohttp, pydantic and SDK code; SQLite is the standard library's). The env is
# rebuilt only when pyproject.toml or scripts/floors.py changes (~20 s with uv's cache); the tests take about 2.5 minutes.
FLOORS_VENV  ?= .venv-floors
FLOORS_BIN   := $(FLOORS_VENV)/bin
FLOORS_TOOLS := pytest pytest-asyncio pytest-timeout hypothesis openapi-spec-validator moto duckdb
FLOORS_TESTS := tests/storage tests/http tests/sdk tests/reliability/test_cluster_failover.py \
                tests/test_tokens.py tests/test_logs.py tests/test_privacy.py --ignore=tests/sdk/test_faults.py \
                --deselect tests/http/test_starvation.py::test_20000_unfinished_heads_leave_the_service_reachable_and_its_log_short \
                -k "not sqlite and not (redis-cluster and http)"

test-floors: $(FLOORS_VENV)/.installed redis-server
	$(FLOORS_BIN)/python scripts/floors.py check
	$(FLOORS_BIN)/pytest -q -p no:cacheprovider $(FLOORS_TESTS)

$(FLOORS_VENV)/.installed: pyproject.toml scripts/floors.py
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_BIN)/pip install --quiet uv
	$(FLOORS_BIN)/python scripts/floors.py requirements $(FLOORS_TOOLS) > $(FLOORS_VENV)/requirements.txt
	$(FLOORS_BIN)/uv pip install --quiet --python $(FLOORS_BIN)/python -r $(FLOORS_VENV)/requirements.txt
	$(FLOORS_BIN)/uv pip install --quiet --python $(FLOORS_BIN)/python --no-deps -e .
	$(FLOORS_BIN)/uv pip check --python $(FLOORS_BIN)/python
	@touch $@

# A longer schemathesis campaign against a live service (tests/fuzz): 500 fuzzed cases per operation and 2000
# call sequences per run, new ones each time, no time limit. CALLER_MEMORY_FUZZ_SEED=<the seed it printed>
# replays a run.
fuzz: install-test redis-server
	CALLER_MEMORY_FUZZ_EXAMPLES=$${CALLER_MEMORY_FUZZ_EXAMPLES:-500} $(BIN)/pytest -q tests/fuzz

# Benchmarks of issue 7 against a hand-written baseline, side by side (about 12 minutes; needs
# redis-server and redis-benchmark). `$(BIN)/python bench/run.py --quick` takes about 2.5 minutes. Results in
# bench/results/perf.json and bench/results/profile-*; see bench/README.md.
bench: install-test redis-server wrk
	$(BIN)/pip install --quiet -r bench/requirements.txt
	$(BIN)/python bench/run.py

format: install-test
	$(BIN)/ruff format service sdk tests examples bench scripts
	$(BIN)/ruff check --fix service sdk tests examples bench scripts

clean:
	rm -rf $(VENV) $(FLOORS_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .import_linter_cache .typecheck
