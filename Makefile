# The two commands of a fresh machine: `make demo` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: demo test crd bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU wheel of torch lies on disk; an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m shard_operator.cli plan -f examples/shardedmodel.yaml --devices "node-a:80GiB*4,node-b:24GiB*2@0.3"

test: $(STAMP)
	$(PY) -m pytest -q -x

crd: $(STAMP)
	$(PY) -m shard_operator.crd > crds/shardedmodels.yaml
	cp crds/shardedmodels.yaml helm/shard-operator/crds/shardedmodels.yaml  # Helm installs CRDs from the chart's crds/

bench: $(STAMP)
	$(PY) bench/plan_scale.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
