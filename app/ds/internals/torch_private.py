"""Every place the app touches torch's private modules, in one place: each may move or change between torch
versions. Written against TORCH_WRITTEN_FOR (and run on 2.11 on a GPU machine)."""
import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode  # the memory plan counts the bytes each op allocates
from torch.utils._pytree import tree_flatten, tree_map

TORCH_WRITTEN_FOR = "2.14"
DYNAMO_LOGGER = "torch._dynamo"
__all__ = ["TorchDispatchMode", "tree_flatten", "tree_map", "default_store", "fake_tensor_mode", "fake_run",
           "dynamo_reset", "is_dynamo_error", "compile_backward_with_forward", "dynamo_graphs", "allow_recompiles",
           "default_recompiles", "record_memory_history", "compiled_forward_graph", "backward",
           "stop_memory_history", "dump_memory_snapshot", "memory_snapshot", "DYNAMO_LOGGER", "TORCH_WRITTEN_FOR",
           "in_backward"]


def default_store():
    """The store the default process group started with, which torch.distributed keeps private."""
    return torch.distributed.distributed_c10d._get_default_store()


def fake_tensor_mode():
    """A mode in which tensors have shapes and dtypes but no storage: models built in it allocate nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    return FakeTensorMode()


@contextlib.contextmanager
def fake_run():
    """Fake tensors through which a model built outside them runs (its real weights taken as fake ones), without
    the log of a failed shape check that they raise again."""
    import logging
    from torch._subclasses.fake_tensor import FakeTensorMode
    quiet = logging.getLogger("torch._subclasses.fake_tensor")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    finally:
        quiet.setLevel(level)


def compiled_forward_graph(step, *args):
    """The forward graph torch.compile's AOTAutograd makes of step(*args) (fake tensors, parameters among args):
    inductor's decompositions and its min-cut partitioner, whose outputs past step's own are the tensors the
    backward keeps. Attention stays one operation, as CUDA's kernels run it (CPU's fused attention would be
    decomposed); the compiling flag is up, as under torch.compile, so library code skips its eager-only checks."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table
    graphs = []

    def forward(graph, _):
        graphs.append(graph)
        return graph

    decompositions = {op: rule for op, rule in select_decomp_table().items() if "flash_attention" not in str(op)}
    traced = aot_function(step, fw_compiler=forward, bw_compiler=lambda graph, _: graph,
                          partition_fn=min_cut_rematerialization_partition, decompositions=decompositions)
    before, torch.compiler._is_compiling_flag = torch.compiler._is_compiling_flag, True
    try:
        traced(*args)
    finally:
        torch.compiler._is_compiling_flag = before
    return graphs[0]


def backward(loss: torch.Tensor):
    """loss.backward() under the torch function modes in force: Tensor.backward, itself a torch function, would
    turn them off for its whole call (the memory plan's CUDA casts, for a checkpointed block's recomputation)."""
    from torch.autograd.graph import _engine_run_backward
    _engine_run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)


def dynamo_reset():
    """Forget every compiled graph (the benchmark measures each mode's compile afresh)."""
    import torch._dynamo
    torch._dynamo.reset()


def dynamo_graphs() -> tuple:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's own counters."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


_DEFAULT_RECOMPILES = {}  # torch's own limits, kept before allow_recompiles first raises them


def allow_recompiles(per_function: int) -> int:
    """Raise torch.compile's limit of graphs kept for one function (8 by default; past it the function runs eager)
    to at least per_function, and its limit of all recompiles with it; the limit now in force."""
    import torch._dynamo.config as config
    if not _DEFAULT_RECOMPILES:
        _DEFAULT_RECOMPILES.update(recompile_limit=config.recompile_limit,
                                   accumulated_recompile_limit=config.accumulated_recompile_limit)
    config.recompile_limit = max(config.recompile_limit, per_function)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, 4 * config.recompile_limit)
    return config.recompile_limit


def default_recompiles():
    """Put back torch's own limits where allow_recompiles raised them (a benchmark mode starts as in a process of
    its own)."""
    import torch._dynamo.config as config
    for name, value in _DEFAULT_RECOMPILES.items():
        setattr(config, name, value)


def is_dynamo_error(error: BaseException) -> bool:
    """Whether torch.compile's own machinery raised error (not the model's code run under it)."""
    from torch._dynamo.exc import TorchDynamoException
    return isinstance(error, TorchDynamoException)


def compile_backward_with_forward():
    """A context in which a compiled forward compiles its backward at once, not at the first backward (where a
    failure would come after the gradient collectives started)."""
    import torch._functorch.config  # not imported by torch itself until something compiles
    return torch._functorch.config.patch(force_non_lazy_backward_lowering=True)


def record_memory_history(max_entries: int):
    """Record this process's CUDA allocations and frees, the last max_entries of them, each allocation with the
    Python frames that made it (not C++'s, which cost far more to unwind), for dump_memory_snapshot."""
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries)


def stop_memory_history():
    """Stop recording CUDA allocations; what was recorded is forgotten."""
    torch.cuda.memory._record_memory_history(enabled=None)


def dump_memory_snapshot(path):
    """Write the CUDA allocator's segments and what was recorded to path, a pickle that pytorch.org/memory_viz
    reads (empty where nothing was recorded)."""
    torch.cuda.memory._dump_snapshot(str(path))


def memory_snapshot() -> dict:
    """The CUDA allocator's segments and what was recorded, as dump_memory_snapshot writes them."""
    return torch.cuda.memory._snapshot()


def in_backward() -> bool:
    """Whether this runs inside autograd's backward (a checkpoint's recomputation of its forward: torch's own
    checkpoint asks the same)."""
    return torch._C._current_graph_task_id() != -1
