# Caller Memory — the two commands a newcomer needs are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PORT   ?= 8080
BIN    := $(VENV)/bin

.PHONY: install install-test run dist test test-floors test-dist test-frameworks-low test-vendors fuzz bench lint format redis-server wrk chromium clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# uv installs into the virtualenv (the test extra with the two voice frameworks: about 150 packages, ~9 s from
# PyPI where pip takes ~60 s); pip stays in it for anything else.
$(BIN)/uv: | $(BIN)/python
	$(BIN)/pip install --quiet uv

UV_INSTALL := $(BIN)/uv pip install --quiet --python $(BIN)/python

# The two distributions (the SDK from sdk/, the service from the root), editable, in a local virtualenv: code
# edits need no reinstall. An editable install puts .dev on sys.path, whose caller_memory/{service,sdk} are links
# to the two folders. Installed again only when a project file changes (the stamps live in the virtualenv:
# deleting it starts afresh).
PROJECT_FILES := pyproject.toml sdk/pyproject.toml hatch_build.py

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/.installed: $(PROJECT_FILES) | $(BIN)/uv
	$(UV_INSTALL) -e ./sdk -e .
	@touch $@

$(VENV)/.installed-test: $(PROJECT_FILES) | $(BIN)/uv
	$(UV_INSTALL) -e ./sdk -e '.[test]'
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
# The tests are type-checked too (a relaxed override in pyproject.toml), finding caller_memory in .dev. No module
# of service/ or sdk/ may pass 600 lines (scripts/structure.py sizes).
lint: install-test
	$(BIN)/ruff check service sdk tests examples bench scripts hatch_build.py
	$(BIN)/ruff format --check service sdk tests examples bench scripts hatch_build.py
	$(BIN)/mypy service sdk
	MYPYPATH=.dev $(BIN)/mypy tests
	$(BIN)/lint-imports
	$(BIN)/python scripts/structure.py sizes

# The frameworks' drop-ins are tested each in a pytest process of its own (see norecursedirs in pyproject.toml),
# while other virtualenvs are built and their tests run beside them, each one's output shown when all have ended:
# the declared floors (test-floors), the built distributions (test-dist) and the low end of the frameworks'
# ranges (test-frameworks-low). They wait on installs and servers more than they compute, so running them side
# by side saves minutes.
FRAMEWORK_TESTS := tests/frameworks/test_pipecat.py tests/frameworks/test_pipecat_twilio.py \
                   tests/frameworks/test_livekit.py tests/frameworks/test_docs_offline.py \
                   tests/frameworks/test_pipecat_mcp.py tests/frameworks/test_livekit_mcp.py
BESIDE := test-floors test-dist test-frameworks-low test-vendors
# The main suite runs in this many pytest-xdist worker processes (each starts its own Redis servers);
# `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 2

test: install-test redis-server chromium lint
	$(BIN)/pytest -q -n $(TEST_WORKERS)
	@logs=$$(mktemp -d); pids=""; \
	for b in $(BESIDE); do $(MAKE) --no-print-directory $$b > $$logs/$$b 2>&1 & pids="$$pids $$!:$$b"; done; \
	failed=0; for t in $(FRAMEWORK_TESTS); do echo "$$t:"; $(BIN)/pytest -q -p no:cacheprovider $$t || failed=1; done; \
	for p in $$pids; do wait $${p%%:*} || failed=1; echo "make $${p#*:}:"; cat $$logs/$${p#*:}; done; \
	rm -rf $$logs; test $$failed = 0

# The declared floors are promises: the lowest version that the two project files allow of every runtime
# dependency (`name==floor`, written by scripts/floors.py) in its own virtualenv, the project installed without
# dependencies over them, and the part of the suite that exercises them: the storage contract suite on SQLite,
# Redis and Redis Cluster, a cluster failover (redis-py's slot-map internals), the HTTP API on Redis and its
# guarded server (aiohttp's RequestHandler), the SDK client. Test tools resolve normally. Left out for time: the
# HTTP API on the cluster (the same aiohttp and pydantic code as on Redis; the cluster client is covered by the
# storage suite), the SDK's kill-and-restart tests, the 20,000-connection flood, and the SQLite variants of the
# HTTP and SDK tests (their Redis variants run the same aiohttp, pydantic and SDK code; SQLite is the standard
# library's). Left out because the frameworks are not installed there: the drop-ins' default channel; and the
# Agora join body checked with agora-agents' own types (it needs pydantic above the project's floor). The env
# is rebuilt only when a project file or scripts/floors.py changes (~20 s with uv's cache); the tests take about
# 2.5 minutes. anyio (the mcp SDK's) resolves there to a release whose pytest plugin imports a name pytest 9
# deprecates; the tests use pytest-asyncio, so that plugin is not loaded.
FLOORS_VENV  ?= .venv-floors
FLOORS_BIN   := $(FLOORS_VENV)/bin
FLOORS_TOOLS := pytest pytest-asyncio pytest-timeout hypothesis openapi-spec-validator moto duckdb twilio opentelemetry-sdk
FLOORS_TESTS := tests/storage tests/http tests/sdk tests/reliability/test_cluster_failover.py \
                tests/test_tokens.py tests/test_logs.py tests/test_privacy.py --ignore=tests/sdk/test_faults.py \
                --deselect tests/http/test_starvation.py::test_20000_unfinished_heads_leave_the_service_reachable_and_its_log_short \
                --deselect tests/sdk/test_channel_default.py::test_both_drop_ins_default_to_the_sdk_channel \
                --deselect tests/sdk/test_agora.py::test_with_the_proxy_the_join_is_agoras_shape_and_holds_no_memory_and_no_number \
                --deselect tests/sdk/test_agora.py::test_without_the_proxy_the_memory_is_one_system_message_of_data \
                --deselect tests/sdk/test_agora.py::test_a_dropped_call_is_offered_as_data_in_both_modes \
                -k "not sqlite and not (redis-cluster and http)"

test-floors: $(FLOORS_VENV)/.installed redis-server
	$(FLOORS_BIN)/python scripts/floors.py check
	$(FLOORS_BIN)/pytest -q -p no:cacheprovider -p no:anyio $(FLOORS_TESTS)

$(FLOORS_VENV)/.installed: $(PROJECT_FILES) scripts/floors.py
	rm -rf $(FLOORS_VENV)
	$(PYTHON) -m venv $(FLOORS_VENV)
	$(FLOORS_BIN)/pip install --quiet uv
	$(FLOORS_BIN)/python scripts/floors.py requirements $(FLOORS_TOOLS) > $(FLOORS_VENV)/requirements.txt
	$(FLOORS_BIN)/uv pip install --quiet --python $(FLOORS_BIN)/python -r $(FLOORS_VENV)/requirements.txt
	$(FLOORS_BIN)/uv pip install --quiet --python $(FLOORS_BIN)/python --no-deps -e ./sdk -e .
	$(FLOORS_BIN)/uv pip check --python $(FLOORS_BIN)/python
	@touch $@

# The low end of the frameworks' supported ranges (docs/frameworks.md, "Supported versions"): every file of
# tests/frameworks on pipecat-ai 1.13.0 and livekit-agents 1.7.0, in a virtualenv of its own (.venv-frameworks-low,
# rebuilt only when a project file or the script changes: ~10 s from uv's cache); the tests take about a minute.
test-frameworks-low: redis-server
	PYTHON=$(PYTHON) ./scripts/frameworks-low

# tests/vendors: the platform adapters' tests with the vendors' own SDKs (Vapi, Retell, ElevenLabs, Telnyx),
# pinned, in a virtualenv of their own (.venv-vendors: vapi-server-sdk caps pydantic-core below .venv's), rebuilt
# only when a project file or the script changes.
test-vendors: redis-server
	PYTHON=$(PYTHON) ./scripts/vendors

# The two distributions, wheels and source archives, into dist/ with the standard build frontend (each built in
# an isolated environment, its wheel from its source archive; nothing is written into the source folders).
dist: install-test
	rm -rf dist
	$(BIN)/python -m build --installer uv --outdir dist sdk
	$(BIN)/python -m build --installer uv --outdir dist .

# The built distributions as a user installs them (tests/dist, beside the main suite as test-floors is): the
# SDK's wheel alone in a fresh virtualenv brings none of the service's packages and drives the service's wheel
# (installed with --no-index --find-links dist/) in another; a framework example runs from the SDK's wheel with
# its extra; both install from git with a subdirectory; the two carry one version and the licence.
test-dist: dist redis-server
	$(BIN)/pytest -q -p no:cacheprovider tests/dist

# A longer schemathesis campaign against a live service (tests/fuzz): 500 fuzzed cases per operation and 2000
# call sequences per run, new ones each time, no time limit. CALLER_MEMORY_FUZZ_SEED=<the seed it printed>
# replays a run.
fuzz: install-test redis-server
	CALLER_MEMORY_FUZZ_EXAMPLES=$${CALLER_MEMORY_FUZZ_EXAMPLES:-500} $(BIN)/pytest -q tests/fuzz

# Benchmarks against a hand-written baseline, side by side (about 12 minutes; needs
# redis-server and redis-benchmark). `$(BIN)/python bench/run.py --quick` takes about 2.5 minutes. Results in
# bench/results/perf.json and bench/results/profile-*; see bench/README.md.
bench: install-test redis-server wrk
	$(BIN)/pip install --quiet -r bench/requirements.txt
	$(BIN)/python bench/run.py

format: install-test
	$(BIN)/ruff format service sdk tests examples bench scripts
	$(BIN)/ruff check --fix service sdk tests examples bench scripts

clean:
	rm -rf $(VENV) $(FLOORS_VENV) .venv-frameworks-low .venv-vendors dist .pytest_cache .mypy_cache .ruff_cache .import_linter_cache
