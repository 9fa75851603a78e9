# The two commands a new user needs: `make run` and `make test`.
# Each does its own set-up (a .venv with the project installed) on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
TRAINERS := $(VENV)/.trainers-installed

.PHONY: run test test-envs test-envs-and-lint lint typecheck pytest bench system-deps vllm-env clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# TRL, verl, SkyRL and a CPU torch, which the integration tests run for real.
$(TRAINERS): $(STAMP) scripts/ensure-trainers.sh
	bash scripts/ensure-trainers.sh $(BIN)/python
	touch $(TRAINERS)

# pydantic-ai, the OpenAI Agents SDK and LangChain, whose native toolsets the integration tests
# and typecheck run against (docs/integrations.md). After $(TRAINERS): two pip runs at once in
# one venv (make -j) would race.
FRAMEWORKS := $(VENV)/.frameworks-installed
$(FRAMEWORKS): $(STAMP) $(TRAINERS) scripts/ensure-frameworks.sh
	bash scripts/ensure-frameworks.sh $(BIN)/python
	touch $(FRAMEWORKS)
typecheck pytest: $(FRAMEWORKS)

# The daemon on the built-in local pool; it prints its URL, where its token is,
# and curl commands to call it (docs/daemon.md). Ctrl-C stops it cleanly.
run: $(STAMP)
	$(BIN)/agent-backend serve

lint: $(STAMP)
	$(BIN)/ruff check agent_backend tests bench
	$(BIN)/ruff format --check agent_backend tests bench
	$(BIN)/lint-imports

# With the trainers installed: the integrations are checked against their real types.
typecheck: $(TRAINERS)
	$(BIN)/mypy agent_backend

system-deps:
	bash scripts/ensure-system-deps.sh test

# vLLM's CPU build in its own venv (.venv-vllm), for the tests against a real policy server
# (tests/support/vllm_server.py). Under CI=true a failed install fails; elsewhere those tests skip.
vllm-env:
	@bash scripts/ensure-vllm-env.sh || { \
	  if [ "$${CI:-}" = "true" ]; then exit 1; fi; \
	  echo "warning: .venv-vllm could not be set up (see above); the vLLM tests will skip" >&2; }

# The MCP clients of tests/test_mcp_clients.py that cannot share .venv: the MCP SDK 1.x and
# langchain-mcp-adapters (which requires mcp<2) in .venv-mcp1, the MCP Inspector from npm in
# .mcp-clients/. Under CI=true a failed install fails; elsewhere the tests that need them skip.
MCP_CLIENTS := .mcp-clients/.ready
$(MCP_CLIENTS): scripts/ensure-mcp-clients.sh
	@if bash scripts/ensure-mcp-clients.sh; then touch $(MCP_CLIENTS); \
	elif [ "$${CI:-}" = "true" ]; then exit 1; \
	else echo "warning: the MCP clients could not be set up (see above); their tests will skip" >&2; fi
pytest: $(MCP_CLIENTS)

# Two workers (pytest-xdist): most tests wait on processes and sockets, not on the CPU. Tests
# sharing the session's Ray or vLLM server run on one worker (tests/conftest.py groups them).
PYTEST_WORKERS ?= 2
# A backstop for what per-test timeouts cannot stop (a teardown after a test's timeout fired, an
# xdist worker that crashed): interrupted, pytest still prints the failures it has seen.
PYTEST_DEADLINE ?= 2700
pytest: $(STAMP) $(TRAINERS) system-deps vllm-env
	timeout -s INT -k 60 $(PYTEST_DEADLINE) $(BIN)/python -m pytest -W error -q --durations=25 -n $(PYTEST_WORKERS) --dist loadgroup

# The test environments share no venv (.venv; .venv-vllm; .venv-mcp1 and npm's): made side by
# side from the start they cost the longest chain's time (.venv, then its trainers and
# frameworks), not the sum.
# `make test` runs the lint among them too: it needs .venv alone (ruff, import-linter, which
# read the sources only), so it runs while the trainers download, not after them.
test-envs:
	$(MAKE) -j4 --no-print-directory --output-sync=target $(FRAMEWORKS) system-deps vllm-env $(MCP_CLIENTS)

test-envs-and-lint:
	$(MAKE) -j4 --no-print-directory --output-sync=target $(FRAMEWORKS) system-deps vllm-env $(MCP_CLIENTS) lint

# mypy (about 100 s of one core from a cold cache) runs beside the tests, which leave a core
# idle for much of their run; its verdict counts as before.
test: test-envs-and-lint
	$(MAKE) -j2 --no-print-directory typecheck pytest

# Benchmarks print figures side by side with their baselines; they are not part of `make test`.
# Each prints its figures side by side with its baseline and PASS/FAIL per target.
# `make bench` runs them all and fails if any figure is missed; each also runs alone.
BENCHES := validator_bench schema_bench ssh_bench daemon_bench mcp_bench ray_bench ray_nodes_bench rollout_bench rollout_resume_bench rollout_vllm_bench async_rl_bench parser_bench exec_bench ssh_fleet_bench schema_fuzz sandbox_bench startup_bench daemon_hostile_bench

bench: $(TRAINERS) system-deps vllm-env
	$(BIN)/python -m pip install --quiet -e '.[dev,bench,tokens,verl]'
	test -x .bench/swerex/bin/swerex-remote || { $(PYTHON) -m venv .bench/swerex && \
	  .bench/swerex/bin/pip install --quiet swe-rex; }
	@status=0; for b in $(BENCHES); do \
	  echo "===== bench/$$b.py"; $(BIN)/python bench/$$b.py || status=1; \
	done; exit $$status

clean:
	rm -rf $(VENV) .venv-vllm .venv-mcp1 .mcp-clients .pytest_cache .mypy_cache .ruff_cache .hypothesis build
