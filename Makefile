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

.PHONY: setup test lint format demo bench bench-dtype bench-gpu bench-cluster lock clean

setup: $(STAMP)

# The exact versions: constraints/cpu.txt (the set the CPU suite passed on) or, where an NVIDIA GPU is
# visible, constraints/gpu.txt (the set the GPU runs used). `make setup CONSTRAINTS=` takes the newest
# versions pyproject.toml allows, on purpose; `make lock` then records them (after `make test` passed).
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
CONSTRAINTS ?= constraints/$(if $(HAVE_GPU),gpu,cpu).txt
# WHEELS: a folder of wheels, for a machine without a package index (pip --no-index --find-links).
WHEELS ?=
PIP := $(PY) -m pip install --disable-pip-version-check -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) \
	$(if $(CONSTRAINTS),-c $(CONSTRAINTS))

# torch: the pinned version, and the build the index gives: PyPI's Linux wheel is a CUDA build (GBs of
# CUDA libraries), a local wheel directory or TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu the
# CPU-only one, TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 the CUDA your driver supports.
# SYSTEM_TORCH=1 makes the venv see $(PYTHON)'s own site-packages (a .pth: also when $(PYTHON) is itself a
# venv, as on GPU images) and keep what is there; it is the default where a GPU is visible and $(PYTHON)
# already has a CUDA torch. A torch already in the venv is kept.
TORCH_VERSION ?= $(or $(shell sed -n 's/^torch==//p' $(CONSTRAINTS) 2>/dev/null),2.13.0)
TORCH_INDEX_URL ?=
SYSTEM_TORCH ?= $(if $(HAVE_GPU),$(shell $(PYTHON) -c "import torch; assert torch.version.cuda" 2>/dev/null && echo 1),0)

# Last, `llama_train.pins check` says which versions are as pinned and what was kept from the system, and
# `llama_train.gpu check` stops the setup when NVIDIA GPUs are visible but the installed torch cannot use
# them (the trainers refuse to start then, too).
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if [ "$(SYSTEM_TORCH)" = 1 ]; then \
	  $(PYTHON) -c "import site; print(*site.getsitepackages(), sep='\n')" \
	    > $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_system_site.pth; \
	  echo "setup: the venv sees $(PYTHON)'s site-packages (SYSTEM_TORCH=1)"; \
	fi
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "setup: keeping torch $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	else \
	  echo "setup: $(if $(HAVE_GPU),NVIDIA GPU found,no NVIDIA GPU), installing torch $(TORCH_VERSION) $(TORCH_INDEX_URL)"; \
	  $(PIP) torch==$(TORCH_VERSION) $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)); \
	fi
	$(PIP) -e ".$(if $(EXTRAS),[$(EXTRAS)])"
	@$(if $(CONSTRAINTS),$(PY) -m llama_train.pins check $(CONSTRAINTS) || true)
	$(PY) -m llama_train.gpu check
	@touch $@

# TEST_WORKERS: pytest-xdist workers, each a whole test file at a time (--dist loadfile: a module's
# shared launches stay in one process). 2 (the default, what CI runs) keeps 2 cores busy: one worker
# leaves them about 42% idle, as a launch mostly waits on process start-up (docs/developing.md);
# TEST_WORKERS=1: one pytest process, no xdist.
TEST_WORKERS ?= 2

test:
	$(MAKE) setup EXTRAS=dev
	$(PY) -m pytest tests -q --durations=15 $(if $(filter-out 1,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile)

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

bench-dtype: setup
	$(PY) scripts/bench_cpu_dtype.py

# One GPU, about 9 minutes: strategies at 125m and 1b, an A/B table of the speed settings, a profile;
# writes docs/benchmarks/<date>-<gpu>-bench-gpu/ (scripts/bench_gpu.py --tiny checks it on CPU)
bench-gpu: setup
	$(PY) scripts/bench_gpu.py

# DDP, ZeRO-1/2/3, FSDP2 on 2 and 4 simulated hosts with shaped links, the planner's prediction beside each
# row; ~12 minutes on 2 cores, as root (scripts/bench_cluster.py); writes docs/benchmarks/<date>-<cpu>-cluster/
bench-cluster: setup setup-multinode
	$(PY) scripts/bench_cluster.py

lock: setup
	$(PY) -m llama_train.pins lock $(or $(CONSTRAINTS),constraints/$(if $(HAVE_GPU),gpu,cpu).txt)

clean:
	rm -rf $(VENV) data_cache outputs .pytest_cache

# Two simulated hosts on this machine (scripts/multinode_sim.sh, tests/test_multinode.py) need
# sshd, pdsh and ip: installs whichever of openssh-server, openssh-client, pdsh, iproute2 is
# missing (apt-get, as root; starts no system-wide sshd). Not part of `setup`: one-machine users
# need none of it.
.PHONY: setup-multinode
setup-multinode:
	bash scripts/multinode_sim.sh install
