"""The DPO family's losses and rewards against their formulas, the answers' log-probabilities against a direct sum,
and the frozen reference's DeepSpeed dict."""
import math

import pytest
import torch

from app.core import preference, resolver
from app.data import DataInfo
from app.settings import Settings
from app.data.chat import IGNORE

BETA, GAMMA = 0.3, 0.7
# pairs of (chosen, rejected) policy log-probabilities, their token counts and the reference's log-probabilities
POLICY = [(-8.0, -15.5), (-40.25, -31.0), (-3.5, -3.25)]
TOKENS = [(6, 9), (20, 11), (2, 2)]
REFERENCE = [(-13.0, -14.0), (-38.0, -33.5), (-3.5, -3.25)]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def inputs(requires_grad: bool = False) -> tuple:
    policy = torch.tensor([[[p, n] for p, n in zip(ps, ns)] for ps, ns in zip(POLICY, TOKENS)], dtype=torch.float64,
                          requires_grad=requires_grad)
    return policy, torch.tensor(REFERENCE, dtype=torch.float64)


def by_hand(kind: str) -> list:
    """[(loss, chosen's reward, rejected's reward)] of each pair, from the formulas."""
    out = []
    for (pc, pr), (nc, nr), (rc, rr) in zip(POLICY, TOKENS, REFERENCE):
        d = (pc - rc) - (pr - rr)
        if kind == "sigmoid":
            out.append((-math.log(sigmoid(BETA * d)), BETA * (pc - rc), BETA * (pr - rr)))
        elif kind == "hinge":
            out.append((max(0.0, 1 - BETA * d), BETA * (pc - rc), BETA * (pr - rr)))
        elif kind == "ipo":
            per_token = (pc - rc) / nc - (pr - rr) / nr
            out.append(((per_token - 1 / (2 * BETA)) ** 2, BETA * (pc - rc), BETA * (pr - rr)))  # TRL's rewards
        else:
            out.append((-math.log(sigmoid(BETA * (pc / nc - pr / nr) - GAMMA)), BETA * pc / nc, BETA * pr / nr))
    return out


@pytest.mark.parametrize("kind", preference.LOSSES)
def test_each_loss_and_its_rewards_follow_the_formula(kind):
    policy, reference = inputs()
    got = torch.stack(preference.pair_losses(kind, BETA, GAMMA, policy, reference), 1)
    assert got.shape == (3, 3) and torch.allclose(got, torch.tensor(by_hand(kind), dtype=torch.float64))
    if kind == "hinge":
        assert got[:, 0].tolist()[0::2] == [0.0, 1.0], "past the margin free; a pair the policy has not moved 1"


def test_simpo_ignores_the_reference():
    policy, reference = inputs()
    for kind, same in (("simpo", True), ("sigmoid", False)):
        a = preference.pair_losses(kind, BETA, GAMMA, policy, reference)[0]
        b = preference.pair_losses(kind, BETA, GAMMA, policy, reference + 5 * torch.tensor([[1.0, -1.0]]))[0]
        assert torch.equal(a, b) == same, kind


def test_the_sigmoid_loss_pulls_the_chosen_up_and_the_rejected_down_by_beta_sigmoid():
    policy, reference = inputs(requires_grad=True)
    loss = preference.pair_losses("sigmoid", BETA, GAMMA, policy, reference)[0].sum()
    loss.backward()
    for i, ((pc, pr), (rc, rr)) in enumerate(zip(POLICY, REFERENCE)):
        pull = BETA * sigmoid(-BETA * ((pc - rc) - (pr - rr)))
        assert math.isclose(policy.grad[i, 0, 0].item(), -pull, rel_tol=1e-12)
        assert math.isclose(policy.grad[i, 1, 0].item(), pull, rel_tol=1e-12)
    assert (policy.grad[..., 1] == 0).all(), "token counts are data"


def test_answer_logps_sum_the_labelled_next_tokens_and_count_them():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11)
    labels = torch.randint(0, 11, (3, 7))
    labels[0, :4], labels[1, :2], labels[2, :] = IGNORE, IGNORE, IGNORE
    labels[1, 5] = IGNORE  # a hole inside the answer too
    got = preference.answer_logps(logits, labels)
    for s in range(3):
        logp = torch.log_softmax(logits[s].double(), -1)
        counted = [t for t in range(1, 7) if labels[s, t] != IGNORE]
        assert math.isclose(got[s, 0].item(), sum(logp[t - 1, labels[s, t]].item() for t in counted), rel_tol=1e-5,
                            abs_tol=1e-5)
        assert got[s, 1].item() == max(len(counted), 1)
    assert got[2, 0] == 0 and got[:, 1].tolist() == [3.0, 4.0, 1.0]
    changed = logits.clone()
    changed[1, 4] += 100 * torch.randn(11)  # predicts position 5, left out
    changed[:, -1] += 100  # predicts nothing
    assert torch.equal(preference.answer_logps(changed, labels), got)


def test_a_preference_model_has_its_dropout_off_and_a_preset_is_drawn_from_the_seed(tmp_path):
    """TRL's disable_dropout: the model and its reference score an answer alike. A folder saved with dropout 0.1
    (GPT-2's defaults) comes back without it; a preset built twice is the same model (its frozen copy)."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from app.data.tokenizers import byte_tokenizer
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=320)).save_pretrained(tmp_path / "gpt2")
    info = DataInfo(0, task="causal_lm", vocab_size=320, seq_len=16)
    for name in (str(tmp_path / "gpt2"), "llama-tiny"):
        task = resolver.build(Settings(model=name, task="preference"))
        task.tokenizer = byte_tokenizer()
        models = [task.build_model(info, {}) for _ in range(2)]
        dropouts = [m for m in models[0].modules() if isinstance(m, torch.nn.Dropout)]
        assert all(m.p == 0.0 for m in dropouts) and (dropouts or name == "llama-tiny"), name
        assert all(torch.equal(a, b) for a, b in zip(models[0].state_dict().values(), models[1].state_dict().values()))


def test_a_pairs_flops_are_two_sequences_trained_and_the_live_references_forward_of_both():
    """Full training: 6 per weight and 2 for the reference (4/3 of training); LoRA: 4 per frozen weight and 2 (3/2);
    precomputed: training alone."""
    from app.core import models
    from app.data.tokenizers import byte_tokenizer
    info = DataInfo(0, task="causal_lm", vocab_size=320, seq_len=16)
    ratios = {}
    for lora, reference in ((False, "live"), (True, "live"), (False, "precompute")):
        task = resolver.build(Settings(model="llama-tiny", task="preference", lora=lora, reference=reference))
        task.tokenizer = byte_tokenizer()
        model = task.build_model(info, {})
        trained = models.train_flops_per_token(model, 16) * 16
        ratios[lora, reference] = task.flops_per_sample(model, info) / (2 * trained)
    assert ratios[False, "precompute"] == 1.0
    assert abs(ratios[False, "live"] - 4 / 3) < 1e-9
    assert 1.45 < ratios[True, "live"] < 1.5  # the adapters' own 6 per weight pull it a little below 3/2
