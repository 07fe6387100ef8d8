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

.PHONY: setup test lint format demo bench bench-dtype bench-gpu bench-cluster lock clean wheels

setup: $(STAMP)

# The exact versions: constraints/cpu.txt (the set the CPU suite passed on) or, where an NVIDIA GPU is
# visible, constraints/gpu.txt (the set the GPU runs used). `make setup CONSTRAINTS=` takes the newest
# versions pyproject.toml allows, on purpose; `make lock` then records them (after `make test` passed).
HAVE_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
CONSTRAINTS ?= constraints/$(if $(HAVE_GPU),gpu,cpu).txt
# WHEELS: a folder of wheels, for a machine without a package index (pip --no-index --find-links); `make
# wheels` writes one into .whl/, which is used by default when it is there.
WHEELS ?= $(if $(wildcard .whl/*.whl),.whl)
# What pip is held to: CONSTRAINTS less the pins of what $(PYTHON) provides under SYSTEM_TORCH=1 (the image's
# own torch, transformers, ...: pinned, pip would try to replace them, and fail without an index).
PINS := $(VENV)/constraints.txt
PIP := $(PY) -m pip install --disable-pip-version-check -q $(if $(WHEELS),--no-index --find-links $(WHEELS)) \
	$(if $(CONSTRAINTS),-c $(PINS))

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
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); $(PYTHON) -m venv --without-pip $(VENV) && \
	  echo "setup: $(PYTHON) has no ensurepip: a venv without pip, which uses $(PYTHON)'s own (SYSTEM_TORCH=1)"; }
	@if [ "$(SYSTEM_TORCH)" = 1 ]; then \
	  $(PYTHON) -c "import site; print(*site.getsitepackages(), sep='\n')" \
	    > $$($(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/_system_site.pth; \
	  echo "setup: the venv sees $(PYTHON)'s site-packages (SYSTEM_TORCH=1)$(if $(WHEELS),; packages from $(WHEELS) only (pip --no-index))"; \
	fi
	@$(if $(CONSTRAINTS),$(PY) -P llama_train/pins.py unprovided $(CONSTRAINTS) > $(PINS))
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

# One GPU, under 9 minutes: setup with what the benchmark needs (no dev extra: no index needed beyond
# .whl/), then 420 s of rows, the goals' first: strategies at 125m and 1b, --compile, an A/B table of the
# speed settings, a profile; writes docs/benchmarks/<date>-<gpu>-bench-gpu/ with the setup's seconds in
# its total (scripts/bench_gpu.py --tiny checks it on CPU)
bench-gpu:
	@start=$$(date +%s); $(MAKE) --no-print-directory setup EXTRAS= && \
	  $(PY) scripts/bench_gpu.py --setup_s $$(( $$(date +%s) - start ))

# The wheel folder for a GPU machine without a package index, made on one with an index (then bring
# .whl/ along; `make setup` uses it): DeepSpeed, which PyPI has only as source, built into a pure wheel
# (its ops compile on first use), and binary wheels for Python WHEEL_PYTHON on x86-64 Linux of every other
# package this project and DeepSpeed need, at constraints/gpu.txt's versions where it pins them (else this
# venv's), less WHEEL_SKIP and what only those need: by default torch and transformers, which a GPU image
# brings (name more that yours has, e.g. numpy pyarrow matplotlib, for a smaller folder); and setuptools for
# the editable install. `python -m llama_train.pins wheels` lists them.
WHEEL_PYTHON ?= 3.12
WHEEL_SKIP ?= torch transformers
WHEEL_PLATFORMS := manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
wheels: setup
	@mkdir -p .whl
	$(PY) -m pip wheel --disable-pip-version-check -q --no-deps -w .whl \
	  deepspeed==$$(sed -n 's/^deepspeed==//p' constraints/gpu.txt)
	$(PY) -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: -d .whl \
	  --python-version $(WHEEL_PYTHON) --implementation cp $(WHEEL_PLATFORMS:%=--platform %) \
	  $$($(PY) -m llama_train.pins wheels constraints/gpu.txt $(WHEEL_PYTHON) "$(WHEEL_SKIP)")
	@echo "wheels: $$(ls .whl | wc -l) in .whl/ ($$(du -sh .whl | cut -f1)), for Python $(WHEEL_PYTHON)"

# DDP, ZeRO-1/2/3, FSDP2 on 2 and 4 simulated hosts with shaped links, the planner's prediction beside each
# row; ~12 minutes on 2 cores, as root (scripts/bench_cluster.py); writes docs/benchmarks/<date>-<cpu>-cluster/
bench-cluster: setup setup-multinode
	$(PY) scripts/bench_cluster.py

lock: setup
	$(PY) -m llama_train.pins lock $(or $(CONSTRAINTS),constraints/$(if $(HAVE_GPU),gpu,cpu).txt)

clean:
	rm -rf $(VENV) data_cache outputs .pytest_cache  # not .whl/: it may have come from another machine

# Two simulated hosts on this machine (scripts/multinode_sim.sh, tests/test_multinode.py) need
# sshd, pdsh and ip: installs whichever of openssh-server, openssh-client, pdsh, iproute2 is
# missing (apt-get, as root; starts no system-wide sshd). Not part of `setup`: one-machine users
# need none of it.
.PHONY: setup-multinode
setup-multinode:
	bash scripts/multinode_sim.sh install
