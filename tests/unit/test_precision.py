"""The precision a run takes (app/ds/precision.py): what it says it picked is what DeepSpeed computes in; TF32."""
import json

import pytest
import torch
from deepspeed.runtime.engine import DeepSpeedEngine

from app.ds import precision
from app.ds.config import load_ds_config
from app.ds.internals import parse_config
from conftest import REPO


class Parsed:
    """DeepSpeed's engine's own precision getters over DeepSpeed's own parse of a dict (no engine is built)."""
    bfloat16_enabled = DeepSpeedEngine.bfloat16_enabled
    fp16_enabled = DeepSpeedEngine.fp16_enabled
    torch_autocast_enabled = DeepSpeedEngine.torch_autocast_enabled
    torch_autocast_dtype = DeepSpeedEngine.torch_autocast_dtype

    def __init__(self, ds: dict):
        self._config = parse_config(json.loads(json.dumps(ds)))


def _shipped(name: str) -> dict:
    return load_ds_config(REPO / "ds_configs" / f"{name}.json", resolve=False)


MICRO = {"train_micro_batch_size_per_gpu": 2}
BOTH = {**MICRO, "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"}}
CASES = [  # the dict, CUDA, native bf16; the precision line, the weights' dtype, the matmuls' dtype
    ("zero2", True, True, "bf16 autocast", torch.float32, torch.bfloat16),
    ("zero2", True, False, "fp32", torch.float32, torch.float32),
    ("zero2", False, False, "fp32", torch.float32, torch.float32),
    ("bf16", False, False, "bf16 autocast", torch.float32, torch.bfloat16),  # true, not "auto": any device
    (BOTH, True, True, "bf16", torch.bfloat16, torch.bfloat16),
    (BOTH, True, False, "fp16", torch.float16, torch.float16),
    (BOTH, False, False, "fp32", torch.float32, torch.float32),
    ({**MICRO, "torch_autocast": {"enabled": "auto", "dtype": "float16"}}, True, False, "fp16 autocast",
     torch.float32, torch.float16),
    ({**MICRO, "fp16": {"enabled": True, "auto_cast": True}}, False, False, "fp32", torch.float32, torch.float32),
    # true without a dtype: DeepSpeed would hand torch.autocast none, fp16 on CUDA, with no loss scaler
    ({**MICRO, "torch_autocast": {"enabled": True}}, True, True, "bf16 autocast", torch.float32, torch.bfloat16),
    ({**MICRO, "torch_autocast": {"enabled": True}}, True, False, "fp16 autocast", torch.float32, torch.float16),
    ({**MICRO, "torch_autocast": {"enabled": True}}, False, False, "bf16 autocast", torch.float32, torch.bfloat16),
]


@pytest.mark.parametrize("ds, cuda, bf16_ok, line, weights, matmuls", CASES)
def test_the_precision_said_at_start_is_the_one_deepspeed_computes_in(ds, cuda, bf16_ok, line, weights, matmuls):
    """The note's words, the precision line and the dtypes of the step all come from the one resolved dict."""
    resolved, note = precision.resolve_precision(_shipped(ds) if isinstance(ds, str) else ds, "c.json", cuda=cuda,
                                                 bf16_ok=bf16_ok)
    built = Parsed(resolved)
    assert precision.precision_name(built) == line
    assert note == "" or note.startswith(f"{line} (")
    assert precision.input_dtype(built) == weights and precision.compute_dtype(built) == matmuls


def test_autocast_picked_by_auto_names_its_dtype_for_deepspeed():
    """Without a dtype DeepSpeed hands torch.autocast None, which on CUDA means fp16, with no loss scaling."""
    resolved, _ = precision.resolve_precision({**MICRO, "torch_autocast": {"enabled": "auto"}}, "c.json", cuda=True,
                                              bf16_ok=True)
    assert resolved["torch_autocast"]["dtype"] == "bfloat16"
    assert Parsed(resolved).torch_autocast_dtype() == torch.bfloat16


def test_fp16_on_a_cpu_trains_in_fp32_without_casting_the_inputs_and_a_gpu_runs_it_as_written():
    fp16 = {**MICRO, "fp16": {"enabled": True, "auto_cast": True}}
    on_cpu, note = precision.resolve_precision(fp16, "c.json", device=torch.device("cpu"))
    config = Parsed(on_cpu)._config.float16_config
    assert not config.enabled and not config.auto_cast, "DeepSpeed casts inputs by auto_cast even with fp16 off"
    assert note.startswith("fp32 (c.json sets fp16.enabled true, which needs a CUDA device")
    on_gpu, note = precision.resolve_precision(fp16, "c.json", cuda=True, bf16_ok=False)
    assert on_gpu == fp16 and note == ""


@pytest.mark.parametrize("capability, native", [((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 9), True),
                                                ((9, 0), True), ((12, 0), True), ([8, 6], True)])
def test_bf16_counts_as_native_from_ampere_on(capability, native):
    assert precision.bf16_runs(capability) is native


@pytest.fixture
def tf32_flags():
    """torch's TF32 switches, put back as they were."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield lambda: (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_fp32_on_cuda_takes_tf32_unless_turned_off_and_says_which(tf32_flags):
    assert precision.set_tf32(torch.device("cuda", 0), torch.float32, "off") == "full-fp32 matmuls (--tf32 off)"
    assert tf32_flags() == (False, False)
    assert precision.set_tf32(torch.device("cuda"), torch.float32, "on") == "TF32 matmuls"
    assert tf32_flags() == (True, True)


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32), ("cuda", torch.bfloat16), ("cuda", torch.float16)])
def test_tf32_is_left_alone_where_no_fp32_matmul_runs_on_cuda(tf32_flags, device, dtype):
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    assert precision.set_tf32(torch.device(device), dtype, "off") == ""
    assert tf32_flags() == (True, True)


def test_autocast_set_true_without_a_dtype_beside_an_auto_section_is_given_the_devices():
    resolved, _ = precision.resolve_precision({**MICRO, "torch_autocast": {"enabled": True},
                                               "fp16": {"enabled": "auto"}}, "c.json", cuda=True, bf16_ok=False)
    assert resolved["torch_autocast"]["dtype"] == "float16" and resolved["fp16"]["enabled"] is False
