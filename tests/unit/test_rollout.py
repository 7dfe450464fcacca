"""Completions drawn inside a run (app/core/rollout.py): each row's draws its own, so a prompt's completions are
the same in any batch, on any rank; the sampling rules (temperature, top-k, top-p, greedy) as TRL's."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList

from app.core import rollout


def test_draws_belong_to_the_seed_step_row_and_completion_alone():
    together = rollout.draws(42, 3, [7, 9], 2, 5)
    assert together.shape == (4, 5) and together.dtype == torch.float64
    assert torch.equal(together[2:], rollout.draws(42, 3, [9], 2, 5)), "row 9's draws wherever it is"
    assert not torch.equal(together, rollout.draws(42, 4, [7, 9], 2, 5)), "another step, other draws"
    assert not torch.equal(together[0], together[1]), "each completion of a group its own"


def test_choose_is_inverse_cdf_sampling_after_temperature_top_k_and_top_p():
    scores = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    plain = rollout.Sampling(1.0, 0, 1.0, 4)
    picks = [int(rollout.choose(scores, torch.tensor([u]), plain)) for u in (0.05, 0.15, 0.35, 0.65, 0.99)]
    assert picks == [0, 1, 2, 3, 3], "the first token whose cumulative probability passes u"
    top2 = rollout.Sampling(1.0, 2, 1.0, 4)
    assert {int(rollout.choose(scores, torch.tensor([u]), top2)) for u in (0.0, 0.3, 0.99)} == {2, 3}
    nucleus = rollout.Sampling(1.0, 0, 0.5, 4)  # 0.4 + 0.3 reach 0.5
    assert {int(rollout.choose(scores, torch.tensor([u]), nucleus)) for u in (0.0, 0.5, 0.99)} == {2, 3}
    assert int(rollout.choose(scores, torch.tensor([0.0]), rollout.Sampling(0.0, 0, 1.0, 4))) == 3, "greedy"
    cold = rollout.Sampling(0.05, 0, 1.0, 4)
    assert int(rollout.choose(scores, torch.tensor([0.5]), cold)) == 3, "a low temperature all but greedy"


def _generated(model, prompts: torch.Tensor, rows: list, how: rollout.Sampling) -> torch.Tensor:
    u = rollout.draws(0, 1, rows, 1, how.max_new)
    width = prompts.shape[1]
    out = model.generate(input_ids=prompts, attention_mask=(prompts != 0).long(),
                         generation_config=rollout.generation_config(how.max_new, (2,), 0),
                         logits_processor=LogitsProcessorList([rollout.Sampler(u, width, 30, how)]))
    new = torch.zeros(len(prompts), how.max_new, dtype=torch.long)  # a batch that ended early is shorter
    new[:, :out.shape[1] - width] = out[:, width:]
    return new


def test_a_prompts_completion_does_not_depend_on_the_batch_it_is_sampled_in():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
    model.eval()
    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 11, 12, 13], [0, 0, 0, 14]])  # left-padded with 0
    how = rollout.Sampling(1.0, 0, 1.0, 8)
    with torch.no_grad():
        whole = _generated(model, prompts, [0, 1, 2, 3], how)
        halves = torch.cat([_generated(model, prompts[:2], [0, 1], how), _generated(model, prompts[2:], [2, 3], how)])
        alone = _generated(model, prompts[3:], [3], how)
    assert torch.equal(whole, halves) and torch.equal(whole[3:], alone)
    assert int(whole.max()) < 30, "tokens past the tokenizer's are never drawn"
    assert len({tuple(row.tolist()) for row in whole}) == 4
    model.generation_config.update(repetition_penalty=3.0, no_repeat_ngram_size=1, min_new_tokens=8)  # a model's own
    with torch.no_grad():
        assert torch.equal(_generated(model, prompts, [0, 1, 2, 3], how), whole), "the model's file shapes nothing"


def test_a_completion_is_kept_up_to_and_with_its_first_end_and_one_without_is_truncated():
    completions = torch.tensor([[5, 9, 6, 9], [5, 6, 7, 8], [9, 1, 1, 1]])
    mask, truncated = rollout.ends(completions, (9,))
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert truncated.tolist() == [False, True, False]
    mask, truncated = rollout.ends(completions, (6, 9))  # a model with two end tokens (Gemma's <end_of_turn>)
    assert mask.tolist() == [[True, True, False, False], [True, True, False, False], [True, False, False, False]]
    assert truncated.tolist() == [False, False, False]


def test_the_cache_counts_a_key_and_a_value_per_layer_and_key_value_head():
    from transformers import GPT2Config, LlamaConfig
    gpt2 = GPT2Config(n_layer=2, n_head=4, n_embd=64)
    assert rollout.cache_bytes(gpt2, rows=3, tokens=10, element=4) == 2 * 2 * 4 * 16 * 10 * 3 * 4
    llama = LlamaConfig(num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, hidden_size=2048,
                        head_dim=64)  # Llama 3.2 1B: grouped-query attention, 8 key-value heads of 64
    assert rollout.cache_bytes(llama, rows=1, tokens=1, element=2) == 2 * 16 * 8 * 64 * 2 == 32768
