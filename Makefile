# bcd: the two commands a new machine needs (only Python 3.11+).
#   make run   - a whole node on the example fake host, with the embedded NATS server
#   make test  - the unit and integration tests
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: run test venv bytecode schema man proto bench bench-e2e bench-fleet images compose-up compose-down clean vm-image vm-test

COMPOSE_DIR ?= state/compose

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m pip install --quiet -e '.[systemd]' > $(VENV)/pystemd-install.log 2>&1 \
	  || echo "pystemd not installed: systemd slice tests will skip (needs libsystemd-dev and pkg-config; see $(VENV)/pystemd-install.log)"
	touch $(STAMP)

venv: $(STAMP)

# bytecode of bcd's own modules, so no process of a node compiles them at start (~1 MiB each)
bytecode: $(STAMP)
	$(BIN)/python -m compileall -q -j 0 shared services bcd controlplane > /dev/null

run: $(STAMP) bytecode
	$(BIN)/bcd up --any-ports-if-taken --log-format text --apply examples/specs/demo.json $(ARGS)

# the import layering first (pyproject.toml [tool.importlinter]: seconds), then the tests;
# the VM suites run beside the rest, in a lane of their own (tests/lanes.py)
test: $(STAMP)
	$(BIN)/lint-imports --no-cache
	$(BIN)/python tests/lanes.py $(PYTEST_ARGS)

schema: $(STAMP)
	$(BIN)/python -m shared.schemas.jsonschema --write docs/schema

# bcd(1), generated from the CLI's parser (`man -l build/man/bcd.1`)
man: $(STAMP)
	$(BIN)/bcd man -o build/man/bcd.1

# the kubelet APIs' generated code, checked in: pod-resources v1 (kube_reaper's client)
# and the device plugin API v1beta1 (services/*/proto/*_pb2*.py; shared/protogen.py)
proto: $(STAMP)
	$(BIN)/python -m services.kube_reaper.proto.generate
	$(BIN)/python -m services.device_plugin.proto.generate
	$(BIN)/python -m services.dra_plugin.proto.generate

bench: $(STAMP)
	$(BIN)/python bench/codec.py
	$(BIN)/python bench/plan.py

bench-e2e: $(STAMP)
	$(BIN)/python bench/e2e.py $(ARGS)

# 1,000 nodes' upstream traffic against a 3-server NATS cluster (bench/fleet.py)
bench-fleet: $(STAMP)
	$(BIN)/python bench/fleet.py $(ARGS)

# bcd's container images with no registry (deploy/images/build.sh): a debootstrap base,
# offline wheels, cached by content (a second run costs seconds). Root and Docker.
images: $(STAMP)
	deploy/images/build.sh

# a node as containers on the example fake host, with an upstream and the reference
# control plane, the demo applied (deploy/compose/node.sh); `bcd status --state-dir $(COMPOSE_DIR)`
compose-up: images
	deploy/compose/node.sh up $(COMPOSE_DIR)

compose-down:
	deploy/compose/node.sh down $(COMPOSE_DIR)

clean:
	rm -rf $(VENV) state .pytest_cache .hypothesis

# the VM suites' Debian guest (deploy/vm/build-image.sh): debootstrap, offline wheels, an ext4
# image made without a loop mount; cached by content under .scratch/vm-cache (BCD_VM_CACHE). Root.
vm-image: $(STAMP)
	deploy/vm/build-image.sh

# the VM suites alone (make test runs them too, where qemu and debootstrap are installed)
vm-test: vm-image
	$(BIN)/python -m pytest tests/vm $(PYTEST_ARGS)
