"""Tasks: each kind of job's loss and accuracy, and which task a model and --task pick."""
import math

import pytest
import torch
import torch.nn.functional as F

from app.core import resolver, tasks
from app.settings import Settings
from app.data import DataInfo
from app.data.chat import IGNORE
from app.errors import UserError


def test_class_loss_and_accuracy():
    logits = torch.tensor([[4.0, 0.0], [0.0, 4.0], [4.0, 0.0]], dtype=torch.bfloat16)
    labels = torch.tensor([0, 1, 1])
    losses = tasks.class_loss(logits, labels)
    assert losses.dtype == torch.float32 and losses.shape == (3,) and losses[2] > losses[0]
    assert torch.allclose(losses, F.cross_entropy(logits.float(), labels, reduction="none"))
    assert tasks.class_correct(logits, labels).tolist() == [1.0, 1.0, 0.0]


def test_language_model_loss_is_the_mean_next_token_cross_entropy_of_each_sample():
    gen = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(3, 6, 11, generator=gen), torch.randint(0, 11, (3, 6), generator=gen)
    losses = tasks.next_token_loss(logits, tokens)
    assert losses.shape == (3,) and losses.dtype == torch.float32
    for i in range(3):
        expected = F.cross_entropy(logits[i, :-1], tokens[i, 1:])
        assert torch.allclose(losses[i], expected, atol=1e-6)
        right = (logits[i, :-1].argmax(-1) == tokens[i, 1:]).float().mean()
        assert tasks.next_token_correct(logits, tokens)[i] == right
    # averaged per sample first: the batch mean equals the mean over every predicted token (equal lengths)
    everything = F.cross_entropy(logits[:, :-1].reshape(-1, 11), tokens[:, 1:].reshape(-1))
    assert torch.allclose(losses.mean(), everything, atol=1e-6)
    assert tasks.next_token_loss(logits.to(torch.bfloat16), tokens).dtype == torch.float32


def test_the_language_model_loss_leaves_out_tokens_labelled_ignore():
    """Prompts and padding (labels of IGNORE) count neither in the loss nor in the accuracy: each sample's loss is
    the mean over its labelled tokens, and a sample labelled on nothing weighs nothing."""
    gen = torch.Generator().manual_seed(1)
    logits, tokens = torch.randn(3, 6, 11, generator=gen), torch.randint(0, 11, (3, 6), generator=gen)
    labels = tokens.clone()
    labels[0, :3] = IGNORE  # a prompt of three tokens
    labels[1, 4:] = IGNORE  # padding after four
    labels[2, 1:] = IGNORE  # nothing to predict
    losses, right = tasks.next_token_loss(logits, labels), tasks.next_token_correct(logits, labels)
    for i, kept in enumerate([range(2, 5), range(0, 3), range(0)]):
        positions = list(kept)  # position t predicts label t + 1
        expected = F.cross_entropy(logits[i, positions], labels[i, [p + 1 for p in positions]]) if positions \
            else torch.tensor(0.0)
        assert torch.allclose(losses[i], expected, atol=1e-6), i
        hits = sum(int(logits[i, p].argmax() == labels[i, p + 1]) for p in positions)
        assert right[i].item() == pytest.approx(hits / max(len(positions), 1))


def test_a_perfect_next_token_guess_scores_one():
    tokens = torch.tensor([[1, 2, 3, 1]])
    logits = torch.full((1, 4, 5), -20.0)
    logits[0, torch.arange(3), tokens[0, 1:]] = 20.0  # position t predicts token t + 1; the last predicts nothing
    assert tasks.next_token_correct(logits, tokens).tolist() == [1.0]
    assert tasks.next_token_loss(logits, tokens).item() < 1e-6


def test_what_each_task_reports():
    image = resolver.build(Settings(model="mlp"))
    assert image.tokens_per_sample == 0 and image.eval_metrics(0.5) == {}
    info = DataInfo(10, 3, 16)
    model = image.build_model(info, {})
    assert model(torch.randn(2, 3, 16, 16)).shape == (2, 10)
    pixels = 3 * 16 * 16  # forward, weight gradients, and the input gradient of all but the first layer
    assert image.flops_per_sample(model, info) == 3 * 2 * (pixels * 64 + 64 * 10) - 2 * pixels * 64
    lm = resolver.build(Settings(model="gpt2-tiny"))
    assert lm.eval_metrics(math.log(50.0)) == {"eval_perplexity": pytest.approx(50.0)}
    assert lm.eval_metrics(1e6)["eval_perplexity"] == math.exp(700), "capped, never an overflow"
    assert resolver.build(Settings(model="bert-tiny")).eval_metrics(0.5) == {}


def test_benchmark_data_of_a_language_model():
    lm = resolver.build(Settings(model="gpt2-tiny"))
    data, info = lm.sample_data(6, 16)
    x, y = data[0]
    assert len(data) == 6 and x.shape == (16,) and torch.equal(x, y) and int(x.max()) < 8192
    assert (info.task, info.vocab_size, info.seq_len, lm.tokens_per_sample) == ("causal_lm", 8192, 16, 16)
    with pytest.raises(UserError, match="bert-tiny is a sequence classifier"):
        resolver.build(Settings(model="bert-tiny")).sample_data(6, 16)


def test_without_dropout_turns_off_the_rates_layers_keep_as_numbers_too():
    """OPT's layers call torch's functional dropout with a rate they keep as a float, and skip layers by LayerDrop:
    a preference or GRPO model scores a sequence the same in training mode as its reference does in eval mode."""
    from transformers import OPTConfig, OPTForCausalLM
    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, ffn_dim=32,
                                     num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=16,
                                     dropout=0.3, attention_dropout=0.3, activation_dropout=0.3, layerdrop=0.3))
    ids = torch.randint(64, (2, 12))
    model.train()
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, model(ids).logits), "the test's model drops out"
        tasks.without_dropout(model)
        trained = model(ids).logits
        assert torch.equal(trained, model(ids).logits)
        assert torch.allclose(trained, model.eval()(ids).logits, atol=1e-6)
