"""Models build by name and fit the data's shape; transformers models from a spec; padded vocabularies masked."""
import pytest
import torch

from app.core import models
from app.data import DataInfo
from app.errors import UserError
from app.core.tasks import next_token_correct, next_token_loss


@pytest.mark.parametrize("name, info", [
    ("cnn", DataInfo(10, 1, 8)), ("cnn", DataInfo(10, 3, 32)), ("mlp", DataInfo(7, 3, 16)),
    ("resnet18", DataInfo(10, 1, 28)), ("resnet34", DataInfo(5, 3, 32)), ("mobilenet_v3_small", DataInfo(4, 1, 32)),
])
def test_models_fit_the_data(name, info):
    model = models.build_model(name, info)
    logits = model.eval()(torch.randn(2, info.in_channels, info.image_size, info.image_size))
    assert logits.shape == (2, info.num_classes)


def test_first_conv_takes_the_data_channels():
    model = models.build_model("resnet18", DataInfo(10, 1, 28))
    assert model.conv1.in_channels == 1 and model.conv1.out_channels == 64 and model.conv1.stride == (2, 2)


def test_unknown_model():
    with pytest.raises(UserError, match="unknown model 'resnet9000'"):
        models.build_model("resnet9000", DataInfo(10, 1, 8))
    assert "resnet50" in models.model_names() and "cnn" in models.model_names() and "gpt2-tiny" in models.model_names()


@pytest.mark.parametrize("name, task, positions", [("cnn", None, None), ("resnet18", None, None),
                                                   ("gpt2-tiny", "causal_lm", 128),
                                                   ("bert-tiny", "sequence_classification", 512)])
def test_hf_spec_is_none_for_image_models_and_names_a_preset_task(name, task, positions):
    spec = models.hf_spec(name)
    assert (spec is None) == (task is None)
    if spec is not None:
        assert (spec.task, spec.max_positions, spec.pretrained) == (task, positions, "")


def test_build_model_is_for_image_models_and_build_hf_for_transformers():
    with pytest.raises(UserError, match="unknown model 'gpt2-tiny'"):
        models.build_model("gpt2-tiny", DataInfo(0, task="causal_lm"))
    from app.data.tokenizers import byte_tokenizer
    model = models.build_hf(models.hf_spec("gpt2-tiny"), DataInfo(0, task="causal_lm"), byte_tokenizer(), {})
    assert isinstance(model, models.HFLogits) and model.real_vocab == 0, "8,192 is a multiple of 64: nothing padded"
    assert model(torch.randint(258, (2, 8))).shape == (2, 8, 8192)
    classifier = models.build_hf(models.hf_spec("bert-tiny"), DataInfo(3, task="sequence_classification"),
                                 byte_tokenizer(), {})
    ids = torch.randint(258, (2, 8))
    assert classifier(ids, torch.ones_like(ids)).shape == (2, 3)
    named = models.build_hf(models.hf_spec("bert-tiny"), DataInfo(2, task="sequence_classification",
                                                                  labels=("neg", "pos")), byte_tokenizer(), {})
    assert named.config.id2label == {0: "neg", 1: "pos"} and named.config.label2id == {"neg": 0, "pos": 1}


def test_preset_vocabulary_is_padded_to_a_multiple_of_64():
    config = models.hf_spec("gpt2-124m").config
    assert (config.vocab_size, models.vocab_size(config)) == (50304, 50257)
    assert models.vocab_size(models.hf_spec("gpt2-tiny").config) == models.hf_spec("gpt2-tiny").config.vocab_size


def test_padded_vocabulary_rows_never_win():
    """The padded tokens' logits are -inf: never the argmax, no probability, the loss over the real tokens only."""
    from transformers import AutoConfig, GPT2LMHeadModel
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, n_positions=16, vocab_size=100,
                                  bos_token_id=None, eos_token_id=None)
    models.pad_vocab(config)
    assert (config.vocab_size, models.vocab_size(config)) == (128, 100)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(config)
    with torch.no_grad():
        hf.lm_head.weight[100:] = 50.0  # padded rows that would win every argmax if they were not masked
    model = models.HFLogits(hf, 100)
    tokens = torch.randint(100, (3, 16))
    logits = model(tokens)
    assert torch.isneginf(logits[..., 100:]).all() and (logits.argmax(-1) < 100).all()
    losses = next_token_loss(logits, tokens)
    expected = next_token_loss(logits[..., :100], tokens)
    assert torch.isfinite(losses).all() and torch.allclose(losses, expected)
    assert (next_token_correct(logits, tokens) == next_token_correct(logits[..., :100], tokens)).all()
    losses.sum().backward()
    assert torch.isfinite(hf.transformer.wte.weight.grad).all()


@pytest.mark.parametrize("name, block, size", [("gpt2-tiny", "GPT2Block", 789_760),
                                               ("llama-1b", "LlamaDecoderLayer", 60_821_504),
                                               ("llama-3b", "LlamaDecoderLayer", 100_669_440),
                                               ("llama-8b", "LlamaDecoderLayer", 218_112_000),
                                               ("bert-tiny", "BertLayer", 198_272)])
def test_a_transformers_models_block_is_known_from_its_config(name, block, size):
    """ZeRO-3's leaf module and prefetch bucket (ds "auto"): the block class and its parameters, from the config
    alone; llama-1b, llama-3b and llama-8b have Llama 3.2 1B's, 3.2 3B's and 3.1 8B's parameter counts."""
    spec = models.hf_spec(name)
    assert models.block_shape(spec) == ((block,), size)
    published = {"llama-1b": 1_235_814_400, "llama-3b": 3_212_749_824, "llama-8b": 8_030_261_248}
    if name in published:
        with torch.device("meta"):
            hf = models.hf_class(spec.task).from_config(spec.config)
        assert sum(p.numel() for p in hf.parameters()) == published[name]


def test_a_model_saved_in_bf16_loads_in_the_jsons_weight_precision(tmp_path):
    """Published models say "dtype": "bfloat16" in config.json, and transformers loads them so: under
    torch_autocast (every shipped file) that would train bf16 weights with no fp32 copy. The JSON decides."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from app.data.tokenizers import byte_tokenizer
    tokenizer = byte_tokenizer()
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=64)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    spec = models.hf_spec(str(tmp_path / "model"))
    assert spec.config.dtype == torch.bfloat16
    info = DataInfo(0, task="causal_lm")
    autocast = {"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}
    for ds_config, dtype in (({}, torch.float32), (autocast, torch.float32), ({"bf16": {"enabled": True}},
                                                                              torch.bfloat16)):
        model = models.build_hf(spec, info, tokenizer, ds_config)
        assert {p.dtype for p in model.parameters()} == {dtype}, ds_config
    preset = models.build_hf(models.hf_spec("llama-tiny"), info, tokenizer, {})
    assert {p.dtype for p in preset.parameters()} == {torch.float32}
