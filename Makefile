# The two commands of a fresh machine: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test test-fast lint system-tools test-tools crd bench images push-images clean

# Each step says what it does first: a first install is quiet for minutes otherwise.
$(STAMP): pyproject.toml $(wildcard worker/shard_worker/csrc/*.[ch])  # the C kernels are built by the install
	@test -x $(PY) || { echo "make: creating the virtualenv $(VENV) (python3 -m venv)"; python3 -m venv $(VENV); }
	@# The CPU wheel of torch lies on disk; an unpinned torch would pull a multi-GB CUDA build.
	@$(PY) -c "import torch" 2>/dev/null || { echo "make: installing torch 2.13.0, the CPU build (a minute or two) ..."; \
		$(PY) -m pip install -q torch==2.13.0; }
	@echo "make: installing shard-operator and its dependencies into $(VENV) (pip install -e '.[dev]', which builds the C decode kernels; about a minute) ..."
	@$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)
	@echo "make: $(VENV) is ready ($(VENV)/bin/shardctl)"

# The main job: a model that fits no single local device budget, sharded over two local ranks
# (`shardctl run`); one completion through the API; the plan, the answer and what each rank
# measured; then every rank stops. The demo model is written once into .cache/.
DEMO_MODEL ?= .cache/demo-model
DEMO_DEVICES ?= localhost:256MiB*2
DEMO_PORT ?= 0
DEMO_PROMPT ?= The lighthouse keeper climbed the stairs
DEMO_SETUP ?= $(STAMP)

demo: $(DEMO_SETUP) $(DEMO_MODEL)/config.json
	$(PY) -m shard_operator.cli run -f examples/local-demo.yaml --model-dir $(DEMO_MODEL) \
		--devices "$(DEMO_DEVICES)" --port $(DEMO_PORT) --prompt "$(DEMO_PROMPT)"
	@echo "(The weights are random, so the answer is noise; serve it yourself with"
	@echo " $(VENV)/bin/shardctl run -f examples/local-demo.yaml --devices \"$(DEMO_DEVICES)\")"

$(DEMO_MODEL)/config.json: | $(DEMO_SETUP)
	@echo "make: writing the demo model (a random Llama) to $(DEMO_MODEL) ..."
	$(PY) -m shard_operator.cli demo-model $(DEMO_MODEL) --force

# Debian packages the tests run for real: chromium (the dashboards in a headless browser) and
# prometheus (its server, and promtool for the chart's alerting rules). Installed when missing.
SYSTEM_TOOLS := chromium prometheus

system-tools:
	@missing=""; for tool in $(SYSTEM_TOOLS); do command -v $$tool >/dev/null || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
		echo "installing$$missing (apt-get)"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

# Binaries the tests run, fetched once per machine into ~/.cache/shard-operator (outside the
# repository; SHARD_TEST_BIN_CACHE moves it): helm and kubectl (tests/support/k8s_binaries.py) and
# checkov and EleutherAI's lm-eval, each in a venv of its own (tests/packaging/scanner.py,
# tests/serving/lmeval.py: both pin libraries the project's venv needs other versions of). Each
# step does nothing when it is there.
test-tools: $(STAMP)
	$(PY) -m tests.support.k8s_binaries
	$(PY) -m tests.packaging.scanner
	$(PY) -m tests.serving.lmeval

# ruff and mypy (configured in pyproject.toml) before any test: a finding fails `make test`.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# Every tier, without -x: a failure does not hide the rest of the run, and -ra lists every one at the end.
test: $(STAMP) lint system-tools test-tools
	$(PY) -m pytest -q

# The pure and unit tiers, in under a minute: the contract, the operator's unit tests with the
# reconcile's table tier, and the worker's tests not marked slow.
test-fast: $(STAMP)
	$(PY) -m pytest -q -x tests/contract tests/operator/unit tests/worker -m "not slow"

crd: $(STAMP)
	$(PY) -m shard_operator.api.crd > crds/shardedmodels.yaml
	cp crds/shardedmodels.yaml helm/shard-operator/crds/shardedmodels.yaml  # Helm installs CRDs from the chart's crds/

bench: $(STAMP)
	$(PY) bench/plan_scale.py

# The two images, named as the chart and the operator expect them (docs/operations.md, "Build and
# push the images"); `make -n images REGISTRY=...` prints the commands without running them.
#   make push-images REGISTRY=registry.example.com/ml                    CUDA worker (cu128)
#   make push-images REGISTRY=registry.example.com/ml TORCH_VARIANT=cpu  CPU worker, tag VERSION-cpu
VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
REGISTRY ?=
TORCH_VARIANT ?= cu128
IMAGE_PREFIX := $(if $(REGISTRY),$(REGISTRY:%/=%)/)
OPERATOR_IMAGE := $(IMAGE_PREFIX)shard-operator:$(VERSION)
WORKER_IMAGE := $(IMAGE_PREFIX)shard-operator-worker:$(VERSION)$(if $(filter cpu,$(TORCH_VARIANT)),-cpu)

images:
	docker build -f Dockerfile.operator -t $(OPERATOR_IMAGE) .
	docker build -f Dockerfile.worker --build-arg TORCH_VARIANT=$(TORCH_VARIANT) -t $(WORKER_IMAGE) .

push-images: images
	docker push $(OPERATOR_IMAGE)
	docker push $(WORKER_IMAGE)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
