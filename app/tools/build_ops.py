"""Build DeepSpeed's JIT ops once during set-up, so the first training run starts in seconds."""
import time

# The ops our ds_configs use: Adam on the accelerator, Adam on the CPU (offload), and on CPU the
# shared-memory communication op that deepspeed.init_distributed loads.
OPS = ("FusedAdamBuilder", "CPUAdamBuilder", "ShareMemCommBuilder")


def main():
    """Load (compiling where not cached) each op this machine's accelerator offers."""
    from app.launch import prepare_environment
    prepare_environment()
    from deepspeed.accelerator import get_accelerator
    accelerator = get_accelerator()
    for name in OPS:
        builder_class = accelerator.get_op_builder(name)
        if builder_class is None:
            continue
        builder = builder_class()
        if not builder.is_compatible(verbose=False):
            print(f"{name}: not compatible with this machine, skipped")
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        print(f"{name}: ready ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
