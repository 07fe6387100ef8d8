# llama-train: `make demo` trains a small LLaMA end to end; `make test` runs the suite.
# Both create .venv themselves. `make setup` creates or updates .venv only (idempotent:
# a second run on an up-to-date venv only checks the stamp).

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# EXTRAS: the optional dependency groups installed with the package. `dev` (pytest, ruff, tensorboard,
# wandb) is what `make test` needs; `make setup EXTRAS=` installs what training needs and nothing else
# (e.g. on a GPU image with no package index for wandb), `EXTRAS=tensorboard` adds one writer.
EXTRAS ?= dev
comma := ,
STAMP := $(VENV)/.llama-train-installed$(if $(EXTRAS),-$(subst $(comma),-,$(EXTRAS)))
PIP := $(PY) -m pip install --disable-pip-version-check -q

.PHONY: setup test lint format demo bench bench-gpu clean

setup: $(STAMP)

# The torch this project is tested with, on CPU and GPU alike: an unpinned install pulls the
# newest torch, whose CUDA may need a newer driver than the machine has (then CUDA is unavailable
# and everything would run on CPU). TORCH_INDEX_URL picks the CUDA build that suits the driver,
# e.g. `make setup TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126`; SYSTEM_TORCH=1 makes
# the venv see the machine's own (CUDA) torch and keep it.
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
SYSTEM_TORCH ?= 0

# Torch first, on its own, pinned; a torch already in the venv is kept. Which build `pip install
# torch==X` gives depends on the index: PyPI's Linux wheel is a CUDA build (GBs of CUDA libraries),
# a local wheel directory or TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gives the CPU-only
# one; `llama_train.gpu check` at the end says which it got. Last, `llama_train.gpu check` stops the setup when NVIDIA GPUs are visible but
# the installed torch cannot use them (the trainers refuse to start then, too).
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(if $(filter 1,$(SYSTEM_TORCH)),--system-site-packages) $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "setup: keeping torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
	  echo "setup: NVIDIA GPU found, installing torch $(TORCH_VERSION) $(TORCH_INDEX_URL)"; \
	  $(PIP) torch==$(TORCH_VERSION) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)); \
	else \
	  echo "setup: no NVIDIA GPU, installing torch $(TORCH_VERSION) $(TORCH_INDEX_URL)"; \
	  $(PIP) torch==$(TORCH_VERSION) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)); \
	fi
	$(PIP) -e ".$(if $(EXTRAS),[$(EXTRAS)])"
	$(PY) -m llama_train.gpu check
	@touch $@

test:
	$(MAKE) setup EXTRAS=dev
	$(PY) -m pytest tests -q --durations=15

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

demo: setup
	bash scripts/demo.sh

bench: setup
	$(PY) scripts/benchmark.py

# One GPU, about 9 minutes: strategies at 125m and 1b, an A/B table of the speed settings, a profile;
# writes docs/benchmarks/<date>-<gpu>-bench-gpu/ (scripts/bench_gpu.py --tiny checks it on CPU)
bench-gpu: setup
	$(PY) scripts/bench_gpu.py

clean:
	rm -rf $(VENV) data_cache outputs .pytest_cache

# Two simulated hosts on this machine (scripts/multinode_sim.sh, tests/test_multinode.py) need
# sshd, pdsh and ip: installs whichever of openssh-server, openssh-client, pdsh, iproute2 is
# missing (apt-get, as root; starts no system-wide sshd). Not part of `setup`: one-machine users
# need none of it.
.PHONY: setup-multinode
setup-multinode:
	bash scripts/multinode_sim.sh install
