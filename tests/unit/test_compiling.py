"""The first compiled step: when --compile compiles, how a failure is classed, and every rank's agreement on it."""
import datetime

import pytest
import torch
import torch.distributed as torch_dist

from app.core import compiling, tasks
from app.ds.internals import torch_private
from app.distributed import endings, wire
from app.errors import Ended, UserError

TASK = tasks.ImageClassification(None)
REFUSED = "RuntimeError: inductor cannot lower aten.special_op"


def _compile_error(backend_raises: BaseException) -> BaseException:
    """The error torch.compile raises when its backend raises backend_raises."""
    def backend(graph, inputs):
        raise backend_raises
    try:
        torch.compile(lambda x: x * 2 + 1, backend=backend)(torch.ones(2))
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("the backend was not run")


@pytest.fixture(scope="module")
def refusal():
    return _compile_error(RuntimeError("inductor cannot lower aten.special_op\n  while lowering node 3"))


class _Engine(torch.nn.Module):
    """What Compiled uses of DeepSpeed's engine: its module and forward hooks, the ZeRO stage, compile(), whether
    DeepCompile compiled the step (CUDA only: a GPU's state, set by a test)."""

    def __init__(self):
        super().__init__()
        self.module, self.device = torch.nn.Linear(4, 3), torch.device("cpu")
        self.optimizer, self.compiled_with, self.deepcompile = None, None, False
        self.module_forward_pre_hook = self.module.register_forward_pre_hook(lambda module, args: None)
        self.module_forward_post_hook = self.module.register_forward_hook(lambda module, args, out: None)

    def compile(self, backend, compile_kwargs):
        self.compiled_with, self._is_compiled = (backend, compile_kwargs), True

    def zero_optimization_stage(self):
        return 2

    def is_deepcompile_active(self):
        return self.deepcompile


def _compiled(board=None, fails=None, eager_fails=None):
    """(Compiled whose graph raises `fails` and whose eager run raises `eager_fails`, the loss each call was
    given: 'compiled' or 'eager')."""
    given = []

    def forward(engine, loss, inputs, labels):
        given.append("eager" if loss is TASK.loss else "compiled")
        failure = fails if given[-1] == "compiled" else eager_fails
        if failure is not None:
            raise failure
        logits = engine.module(inputs[0])
        return logits, TASK.loss(logits, labels)
    return compiling.Compiled(_Engine(), TASK, forward, board or endings.Board()), given


BATCH = ([torch.ones(2, 4)], torch.tensor([0, 2]))


@pytest.mark.parametrize("choice, device, compiled", [("on", "cpu", True), ("on", "cuda", True),
                                                      ("off", "cuda", False), ("auto", "cuda", True),
                                                      ("auto", "cpu", False), ("off", "cpu", False)])
def test_compile_on_compiles_anywhere_and_auto_only_for_cuda(choice, device, compiled):
    assert compiling.wanted(choice, torch.device(device)) is compiled


def test_a_run_that_must_not_compile_trains_eager_on_auto_and_refuses_on(capsys):
    why = "LoRA's reference inside ZeRO-3's compiled step crashed on a GPU"
    assert compiling.wanted("auto", torch.device("cuda"), why) is False
    assert capsys.readouterr().out == f"compile: off, eager: {why}\n"
    assert compiling.wanted("off", torch.device("cuda"), why) is False
    with pytest.raises(UserError, match="--compile on: LoRA's reference .* pass --compile off"):
        compiling.wanted("on", torch.device("cpu"), why)


def test_an_eager_run_says_the_files_deepcompile_does_nothing(capsys):
    """DeepCompile runs only through engine.compile(): a GPU run kept eager says the file's ask goes unanswered."""
    assert compiling.wanted("off", torch.device("cuda"), deepcompile=True) is False
    assert capsys.readouterr().out == ('compile: eager (--compile off), so the DeepSpeed config\'s "deepcompile": '
                                       'true does nothing: DeepSpeed\'s DeepCompile runs in compiled runs only '
                                       '(--compile on)\n')
    assert compiling.wanted("auto", torch.device("cuda"), deepcompile=True) is True
    assert capsys.readouterr().out == ""
    assert compiling.wanted("auto", torch.device("cuda"), "a reason", deepcompile=True) is False
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "compile: off, eager: a reason" and '"deepcompile": true does nothing' in out[1]


def test_the_compilers_own_refusal_is_a_compile_outcome_naming_the_innermost_error(refusal):
    assert compiling._outcome(None) == ("", "")
    assert compiling._outcome(refusal) == ("compile", REFUSED)


def test_out_of_memory_while_compiling_ends_the_run_with_the_advice():
    kind, why = compiling._outcome(_compile_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate "
                                                                         "8.00 GiB")))
    assert kind == "fatal" and why.startswith("out of memory (OutOfMemoryError: CUDA out of memory.")
    assert why.endswith(endings.MEMORY_ADVICE)


def test_a_collective_that_failed_under_the_compiler_ends_the_run():
    store = torch_dist.HashStore()
    store.set_timeout(datetime.timedelta(milliseconds=50))
    with pytest.raises(torch_dist.DistError) as timed_out:
        store.get("never-set")
    assert compiling._outcome(_compile_error(timed_out.value))[0] == "fatal"


def test_the_models_own_error_under_the_compiler_is_not_the_compilers():
    def model(x):
        if x.sum() > 0:
            raise ValueError("labels out of range: 12 >= 10")
        return x
    with pytest.raises(ValueError) as caught:
        torch.compile(model, backend="eager")(torch.ones(2))
    assert compiling._outcome(caught.value) == ("fatal", "ValueError: labels out of range: 12 >= 10")


def test_describe_says_the_innermost_error_in_one_short_line():
    inner = RuntimeError("the real complaint\nwith a traceback's worth of detail")
    outer = RuntimeError("wrapper")
    outer.inner_exception = inner
    assert compiling.describe(outer) == "RuntimeError: the real complaint"
    assert len(compiling.describe(ValueError("x" * 1000))) == len("ValueError: ") + 300
    looped, other = ValueError("a"), KeyError("b")
    looped.__context__, other.__context__ = other, looped
    assert compiling._chain(looped) == [looped, other], "an exception chain that loops ends"


def test_a_compiled_step_runs_compiled_once_every_mode_proved_itself():
    compiled, given = _compiled()
    assert compiled.engine.compiled_with == ("inductor", {"dynamic": False}) and compiled.compiled
    logits, losses = compiled(*BATCH)
    assert logits.shape == (2, 3) and losses.shape == (2,)
    compiled(*BATCH)
    assert compiled.board.rounds == 0 and compiled.proven == {True}
    compiled.engine.eval()
    compiled(*BATCH)
    assert compiled.proven == {True, False} and given == ["compiled"] * 3


def test_a_graph_the_compiler_refuses_sends_the_run_eager_and_redoes_the_step(refusal, capsys):
    compiled, given = _compiled(fails=refusal)
    _, losses = compiled(*BATCH)
    assert losses.shape == (2,) and given == ["compiled", "eager"]
    said = capsys.readouterr().out.splitlines()
    assert said[-1] == f"compile: ZeRO stage 2 could not be compiled on rank 0 ({REFUSED}); every rank runs eager"
    assert not compiled.compiled and compiled.loss is TASK.loss and compiled.engine._is_compiled is False
    compiled(*BATCH)
    compiled.engine.eval()
    compiled(*BATCH)
    assert given[2:] == ["eager", "eager"], "no second attempt, in any mode"


def test_another_ranks_refusal_sends_this_rank_eager_too(capsys):
    """Rank 0 compiled its step; rank 1 could not: rank 0 redoes the step eager, as rank 1 does."""
    store = torch_dist.HashStore()
    store.set("app/run0/round1/1", wire.encode(["compile", REFUSED]))
    store.set("app/run0/round1/1/read", "1")
    board = endings.Board()
    board.store, board.world = store, 2
    compiled, given = _compiled(board)
    compiled(*BATCH)
    assert given == ["compiled", "eager"] and not compiled.compiled
    assert f"could not be compiled on rank 1 ({REFUSED}); every rank runs eager" in capsys.readouterr().out


def test_a_step_deepcompile_could_not_compile_ends_the_run_in_one_line(refusal):
    """DeepCompile's set-up takes ZeRO's own gradient and gather hooks off for good: no eager step is left."""
    compiled, given = _compiled(fails=refusal)
    compiled.engine.deepcompile = True
    with pytest.raises(UserError, match=r"^DeepSpeed's DeepCompile could not compile ZeRO stage 2's training step on "
                                        r"rank 0 \(RuntimeError: .*\) and cannot fall back to eager: set "
                                        r"\"deepcompile\" false in the file's compile section, or pass --compile off$"):
        compiled(*BATCH)
    assert given == ["compiled"], "no eager attempt"


def test_an_error_that_eager_would_not_cure_ends_the_run_naming_the_rank():
    compiled, _ = _compiled(fails=ValueError("labels out of range: 12 >= 10\n(at batch 0)"))
    compiled.engine.eval()
    with pytest.raises(UserError, match="^the first evaluation step failed on rank 0: ValueError: labels out of "
                                        "range: 12 >= 10$") as caught:
        compiled(*BATCH)
    assert caught.value.__cause__ is None and caught.value.__suppress_context__


def test_a_step_that_fails_eager_too_is_the_models_own_error(refusal):
    compiled, given = _compiled(fails=refusal, eager_fails=IndexError("target 7 is out of bounds"))
    with pytest.raises(UserError, match="^the first training step failed on rank 0: IndexError: target 7 is out of "
                                        "bounds$"):
        compiled(*BATCH)
    assert given == ["compiled", "eager"]


def test_a_rank_failing_while_the_others_went_on_into_the_step_ends_alone():
    board = endings.Board()
    board.store, board.world, board.asked = torch_dist.HashStore(), 2, True
    compiled, _ = _compiled(board, fails=torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1 GiB"))
    with pytest.raises(Ended) as caught:
        compiled(*BATCH)
    assert caught.value.alone and str(caught.value).startswith(
        "the first training step failed on rank 0: out of memory (OutOfMemoryError: CUDA out of memory.")
    assert str(caught.value).endswith("; the other ranks went on into that step's collectives")


def test_an_error_chained_to_itself_is_described_and_the_description_ends():
    error = ValueError("the model's own complaint")
    error.__cause__ = error
    assert "the model's own complaint" in compiling.describe(error)


class _Tagged(torch.nn.Module):
    """A block whose forward reads an integer of its weight, as DeepSpeed's linear reads its ds_id: torch.compile
    guards the block's graph on it, so each block needs a graph of its own."""

    def __init__(self, tag: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(4))
        self.weight.tag = tag

    def forward(self, x):
        return x * self.weight + self.weight.tag


def test_every_zero3_leaf_block_keeps_a_compiled_graph_past_torchs_limit_of_8():
    import torch._dynamo.config as config
    with config.patch(recompile_limit=8, accumulated_recompile_limit=256):  # torch's defaults, put back after
        _twelve_blocks_each_compiled(config)


def _twelve_blocks_each_compiled(config):
    from deepspeed.utils import set_z3_leaf_modules
    from torch._dynamo.utils import counters
    assert compiling.allow_a_graph_per_block(torch.nn.Sequential(torch.nn.Linear(4, 4))) == 0
    assert config.recompile_limit == 8
    model = torch.nn.Sequential(*[_Tagged(i) for i in range(12)])
    set_z3_leaf_modules(model, [_Tagged])
    assert compiling.allow_a_graph_per_block(model) == 2 * 12 + 8
    torch._dynamo.reset()
    counters.clear()
    for block in model:
        block.compile(backend="eager")
    x = torch.ones(4)
    for block in model:
        x = block(x)
    assert counters["stats"]["unique_graphs"] == 12  # with torch's limit of 8, the last 4 would run eager
    assert torch.equal(x, torch.full((4,), 1.0 + sum(range(12))))
    torch._dynamo.reset()
    torch_private.default_recompiles()  # as the benchmark starts each mode
    assert (config.recompile_limit, config.accumulated_recompile_limit) == (8, 256)
