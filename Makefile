# gpuops.clean_slate developer entry points.
#   make demo   set up, then crash an SGLang server on a simulated 8-GPU node and give it a clean slate
#   make demo-shell   a simulated node with that crash and a shell beside it (CMD="..." runs that instead)
#   make test   set up, then run every gate and test (what CI runs)
# Both do their own setup on a fresh clone and are quick the second time.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
ROOT := $(abspath $(dir $(lastword $(MAKEFILE_LIST))))
VENV := $(ROOT)/.venv
BIN := $(VENV)/bin
PY := $(BIN)/python
SIM_BUILD := $(ROOT)/tests/sim/build
COLL_LINK := $(ROOT)/ansible_collections/gpuops/clean_slate
# Test-only downloads (community.proxmox for the lab's pct_remote container, wheels for its hypervisors).
TEST_DEPS := $(ROOT)/.build/test-deps.json
# Debian's Prometheus and node_exporter, unpacked, not installed (tools/install-system-deps says why).
DEBIAN := $(ROOT)/.build/debian
PYTEST_ARGS ?=

export ANSIBLE_CONFIG := $(ROOT)/ansible.cfg
export ANSIBLE_COLLECTIONS_PATH := $(ROOT)
export PATH := $(BIN):$(PATH)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: all setup test demo demo-shell sanity units functional host lab lint docs build bench clean distclean

all: setup

## ---------------------------------------------------------------- setup
setup: $(VENV)/.stamp $(VENV)/.testkit $(SIM_BUILD)/.stamp $(COLL_LINK) $(VENV)/.get-pip-shim $(TEST_DEPS) $(DEBIAN)/usr/bin/prometheus

$(DEBIAN)/usr/bin/prometheus:
	@tools/install-system-deps

$(VENV)/.stamp: tests/requirements.txt
	@tools/install-system-deps
	@py=$$(tools/pick-python); \
	  if [ -x "$(PY)" ] && [ "$$($(PY) -c 'import sys; print(sys._base_executable)' 2>/dev/null)" != "$$py" ]; then rm -rf "$(VENV)"; fi; \
	  [ -x "$(PY)" ] || { echo "creating $(VENV) with $$py"; "$$py" -m venv "$(VENV)"; }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r tests/requirements.txt
	@touch $@

# The test kit, installed into the venv as a .pth file: the checkout (for ansible_collections.gpuops.clean_slate),
# tests/ (support, lab), tests/sim (gpusim, pvesim) and tools/ (bench) on every venv Python's path, so that no test,
# benchmark or tool patches sys.path. tests/README.md and tools/README.md map the trees.
$(VENV)/.testkit: $(VENV)/.stamp Makefile
	@$(PY) -c 'import sys, sysconfig; open(sysconfig.get_paths()["purelib"] + "/gpuops_clean_slate_testkit.pth", "w").write("\n".join(sys.argv[1:]) + "\n")' \
	  "$(ROOT)" "$(ROOT)/tests" "$(ROOT)/tests/sim" "$(ROOT)/tools"
	@touch $@

$(SIM_BUILD)/.stamp: $(VENV)/.stamp $(wildcard tests/sim/nvml/*.c tests/sim/nvml/*.h tests/sim/nvml/*.py tests/sim/Makefile)
	$(MAKE) -s -C tests/sim VENV=$(VENV)
	@touch $@

$(COLL_LINK):
	@mkdir -p $(dir $@)
	@ln -sfn ../.. $@

$(TEST_DEPS): $(VENV)/.stamp tools/fetch_test_deps.py
	@$(PY) tools/fetch_test_deps.py

$(VENV)/.get-pip-shim: $(VENV)/.stamp
	@tools/write-get-pip-shim $(PY)
	@touch $@

## ---------------------------------------------------------------- main job
demo: setup
	@tools/pidns-run $(PY) tools/demo/demo.py

# A simulated node with the demo's crash, and a shell beside it (or CMD="...": that command instead).
demo-shell: setup
	@tools/pidns-run $(PY) tools/demo/demo.py --shell -- $(CMD)

## ---------------------------------------------------------------- gates
test: setup
	@tools/run-gates

sanity: setup
	@tools/sanity

# Tests that signal real processes run in a private PID namespace.
units: setup
	tools/pidns-run $(BIN)/pytest -q -p no:cacheprovider tests/unit $(PYTEST_ARGS)

# Two workers, each in a PID namespace of its own (tools/functional says why); GPUOPS_TEST_WORKERS=1 for one.
functional: setup
	tools/functional $(PYTEST_ARGS)

# The host path (initial PID namespace, /dev): guarded so that it can signal only its own victims
# (tests/host/conftest.py says how); deliberately not under pidns-run.
host: setup
	$(BIN)/pytest -q -p no:cacheprovider tests/host $(PYTEST_ARGS)

lab: setup
	tools/pidns-run $(BIN)/pytest -q -p no:cacheprovider tests/lab $(PYTEST_ARGS)

lint: setup
	@tools/lint

docs: setup
	@tools/docs

build: setup
	@tools/build-artifact

# Benchmarks print tables; they are not tests (make test does not run them).
bench: setup
	$(PY) tools/bench/kill_verify.py
	$(PY) tools/bench/inventory.py
	tools/pidns-run $(PY) tools/bench/role.py
	tools/pidns-run $(PY) tools/bench/fleet.py
	tools/pidns-run $(PY) tools/bench/residue.py
	tools/pidns-run $(PY) tools/bench/server_stop.py
	tools/pidns-run $(PY) tools/bench/peers.py
	tools/pidns-run $(PY) tools/bench/sim.py
	tools/pidns-run $(PY) tools/bench/probe.py

clean:
	rm -rf .build tests/output $(SIM_BUILD) gpuops-clean_slate-*.tar.gz

distclean: clean
	rm -rf $(VENV) ansible_collections
