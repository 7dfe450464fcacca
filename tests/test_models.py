"""Models build by name, fit the data's shape, and the loss is fp32 whatever the precision."""
import pytest
import torch

from app import models
from app.data import DataInfo
from app.errors import UserError


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
    assert "resnet50" in models.model_names() and "cnn" in models.model_names()


def test_loss_and_accuracy():
    logits = torch.tensor([[4.0, 0.0], [0.0, 4.0], [4.0, 0.0]], dtype=torch.bfloat16)
    labels = torch.tensor([0, 1, 1])
    losses = models.per_sample_loss(logits, labels)
    assert losses.dtype == torch.float32 and losses.shape == (3,) and losses[2] > losses[0]
    assert models.correct(logits, labels).tolist() == [1.0, 1.0, 0.0]


def test_language_model_loss_is_the_mean_next_token_cross_entropy_of_each_sample():
    from app.models import correct, per_sample_loss
    gen = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(3, 6, 11, generator=gen), torch.randint(0, 11, (3, 6), generator=gen)
    for i in range(3):
        expected = torch.nn.functional.cross_entropy(logits[i, :-1], tokens[i, 1:])
        assert torch.allclose(per_sample_loss(logits, tokens)[i], expected, atol=1e-6)
        assert correct(logits, tokens)[i] == (logits[i, :-1].argmax(-1) == tokens[i, 1:]).float().mean()


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
    losses = models.per_sample_loss(logits, tokens)
    expected = models.per_sample_loss(logits[..., :100], tokens)
    assert torch.isfinite(losses).all() and torch.allclose(losses, expected)
    assert (models.correct(logits, tokens) == models.correct(logits[..., :100], tokens)).all()
    losses.sum().backward()
    assert torch.isfinite(hf.transformer.wte.weight.grad).all()
