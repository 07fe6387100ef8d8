"""Build DeepSpeed's CPU ops (shm allreduce, cpu_adam) into $TORCH_EXTENSIONS_DIR: run once by
tests/conftest.py before any timed launch."""

from deepspeed.accelerator import get_accelerator

for name in ("ShareMemCommBuilder", "CPUAdamBuilder"):
    builder = get_accelerator().create_op_builder(name)
    if builder is not None and builder.is_compatible():
        builder.load()
