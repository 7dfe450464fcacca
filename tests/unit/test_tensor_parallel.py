"""Tensor parallelism through DeepSpeed AutoTP, in one process: the "tensor_parallel" section, the ranks of a
group sharing one replica, which model families it takes. llama-tiny trained on 2 gloo ranks:
tests/e2e/test_tensor_parallel.py."""
import json

import pytest

from app.core import models
from app.parallel import tensor_parallel
from app.data import DataInfo
from app.data.tokenizers import byte_tokenizer
from app.errors import UserError
from conftest import REPO

DP = json.loads((REPO / "ds_configs" / "dp.json").read_text())
TP = json.loads((REPO / "ds_configs" / "tensor_parallel.json").read_text())


def test_the_shipped_config_asks_for_two_shards():
    assert tensor_parallel.size(TP, 2, "tensor_parallel.json") == 2 and tensor_parallel.size(DP, 3, "dp.json") == 1


@pytest.mark.parametrize("changes, world, text", [
    ({"tensor_parallel": {"autotp_size": 2}}, 3, "autotp_size 2 does not divide the world size 3"),
    ({"tensor_parallel": {"autotp_size": 0}}, 2, "autotp_size must be a positive integer"),
    ({"tensor_parallel": {"autotp_size": 2}, "pipeline": {"stages": 2}}, 4, "not both at once"),
    ({"tensor_parallel": {"autotp_size": 2}, "zero_optimization": {"stage": 3}}, 2, "ZeRO stage 0, 1 or 2"),
])
def test_a_wrong_tensor_parallel_section_is_one_line(changes, world, text):
    with pytest.raises(UserError) as caught:
        tensor_parallel.size({**DP, **changes}, world, "x.json")
    assert text in str(caught.value) and "\n" not in str(caught.value)


def test_a_tensor_parallel_group_shares_one_replica():
    """DeepSpeed puts a group's shards on consecutive ranks: 4 ranks x 2 shards are replicas 0, 0, 1, 1."""
    assert [tensor_parallel.data_parallel(2, 4, rank) for rank in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]


def test_llama_has_a_plan_and_gpt2_gets_one_line_naming_the_families():
    info = DataInfo(0, task="causal_lm")
    llama = models.build_hf(models.hf_spec("llama-tiny"), info, byte_tokenizer(), {})
    tensor_parallel.check_model(llama, "llama-tiny")
    assert llama._tp_plan["lm_head"] == "colwise_gather_output", "the output layer's entry reaches AutoTP"
    gpt2 = models.build_hf(models.hf_spec("gpt2-tiny"), info, byte_tokenizer(), {})
    with pytest.raises(UserError, match=r"gpt2-tiny \(gpt2\) has no tensor-parallel plan.*llama, qwen2"):
        tensor_parallel.check_model(gpt2, "gpt2-tiny")
    with pytest.raises(UserError, match="cnn .an image model. has no tensor-parallel plan"):
        tensor_parallel.check_model(models.build_model("cnn", DataInfo(10, 1, 8)), "cnn")
