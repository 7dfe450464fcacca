"""DeepSpeed's sequence-parallel groups (deepspeed.runtime.sequence_parallel.parallel_state_sp, an mpu made once
per process) and the Ulysses attention the app puts in transformers' registry (app/parallel/sequence_parallel.py)."""
import contextlib


def sequence_groups(ds: dict):
    """The mpu deepspeed.initialize takes for the JSON's "sequence_parallel_size" > 1 (DeepSpeed's
    parallel_state_sp, its groups made once per process), or None without it.

    DeepSpeed's all-to-all (deepspeed/sequence/layer.py) finds its group by name in a registry each Ulysses module
    writes when it is made. The app makes them at the first forward of each batch size, which may run inside a
    compiled region, where the write lands after the all-to-all reads it (a KeyError of the group's name): the
    group is registered here, once made, outside any compiled region."""
    degree = ds.get("sequence_parallel_size", 1)
    if degree == 1:
        return None
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.sequence.layer import register_all_to_all_group
    if mpu._SEQUENCE_PARALLEL_GROUP is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=degree)
    register_all_to_all_group(mpu.get_sequence_parallel_group())
    return mpu


@contextlib.contextmanager
def whole_sequences():
    """Inside: the models attend as transformers does, over whatever sequences they are given (online RL samples
    each completion whole on one rank), each Ulysses attention's core put back in the registry, and the Ulysses
    attention after."""
    import sys
    if "transformers.modeling_utils" not in sys.modules:
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    wrapped = {name: ALL_ATTENTION_FUNCTIONS[name] for name in list(ALL_ATTENTION_FUNCTIONS.keys())
               if getattr(ALL_ATTENTION_FUNCTIONS[name], "app_core", None) is not None}
    try:
        for name, ulysses in wrapped.items():
            ALL_ATTENTION_FUNCTIONS[name] = ulysses.app_core
        yield
    finally:
        for name, ulysses in wrapped.items():
            ALL_ATTENTION_FUNCTIONS[name] = ulysses


def forget_sequence_groups():
    """Let a later engine of this process make its own sequence-parallel groups, and its models attend as
    transformers does: the groups released, each Ulysses attention replaced by the core it wraps."""
    import sys
    from deepspeed.runtime.sequence_parallel import parallel_state_sp
    parallel_state_sp._release_sequence_parallel_groups()
    if "transformers.modeling_utils" not in sys.modules:  # no transformers model in this process: nothing wrapped
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    for name in list(ALL_ATTENTION_FUNCTIONS.keys()):
        core = getattr(ALL_ATTENTION_FUNCTIONS[name], "app_core", None)
        if core is not None:
            ALL_ATTENTION_FUNCTIONS[name] = core
