"""torch's private modules as the app uses them (app/ds/internals/torch_private.py), checked against this torch."""
import logging
import re

import pytest
import torch
import torch._functorch.config as functorch_config
from torch._dynamo.exc import InternalTorchDynamoError, Unsupported
from torch._subclasses.fake_tensor import FakeTensor

from app.ds.internals import torch_private
from conftest import REPO


def test_every_name_the_app_takes_from_here_is_exported():
    used = {name for path in (REPO / "app").rglob("*.py")
            for name in re.findall(r"\btorch_private\.(?!py\b)(\w+)", path.read_text())}
    assert {"fake_tensor_mode", "is_dynamo_error", "compile_backward_with_forward"} <= used
    assert sorted(used - set(torch_private.__all__)) == []
    assert [name for name in torch_private.__all__ if not hasattr(torch_private, name)] == []


def test_the_module_is_written_for_the_torch_that_requirements_txt_pins():
    pinned = re.search(r"^torch==(\d+\.\d+)", (REPO / "requirements.txt").read_text(), re.M).group(1)
    assert torch_private.TORCH_WRITTEN_FOR == pinned


def test_a_model_far_larger_than_this_machine_is_built_and_run_in_the_fake_mode_without_memory():
    """The memory plan builds the user's model there: 4 TB of weights that would fail to allocate for real."""
    with torch_private.fake_tensor_mode():
        layer = torch.nn.Linear(10**6, 10**6)
        out = layer(torch.randn(2, 10**6))
    assert isinstance(layer.weight, FakeTensor) and layer.weight.shape == (10**6, 10**6)
    assert isinstance(out, FakeTensor) and out.shape == (2, 10**6) and out.dtype == torch.float32


def test_the_backward_compiles_with_the_forward_inside_the_block_only():
    """A failure in a lazily compiled backward would come after the gradient collectives started."""
    before = functorch_config.force_non_lazy_backward_lowering
    with torch_private.compile_backward_with_forward():
        assert functorch_config.force_non_lazy_backward_lowering is True
    assert functorch_config.force_non_lazy_backward_lowering == before


@pytest.mark.parametrize("error, dynamos", [(Unsupported("generator"), True), (InternalTorchDynamoError("x"), True),
                                            (RuntimeError("shape mismatch"), False), (ValueError("x"), False),
                                            (torch.OutOfMemoryError("x"), False)])
def test_only_errors_of_torch_compiles_own_machinery_count_as_compiler_failures(error, dynamos):
    """A compiler failure falls back to eager; the model's own error would fail there too."""
    assert torch_private.is_dynamo_error(error) is dynamos


def test_dynamos_own_warnings_reach_a_handler_on_the_logger_named_here():
    """The benchmark listens there for the compiler giving up on a model."""
    import torch._dynamo.convert_frame as convert_frame
    heard = []
    handler = logging.Handler()
    handler.emit = lambda record: heard.append(record.getMessage())
    logging.getLogger(torch_private.DYNAMO_LOGGER).addHandler(handler)
    try:
        convert_frame.log.warning("torch._dynamo hit config.recompile_limit (8)")
    finally:
        logging.getLogger(torch_private.DYNAMO_LOGGER).removeHandler(handler)
    assert heard == ["torch._dynamo hit config.recompile_limit (8)"]
