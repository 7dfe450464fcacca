"""Packing: rows grouped into nearly full blocks, each row once; position ids restarting per row keep the attention
inside each row on the implementations a user can pick on a CPU (per-row losses packed equal unpacked within
1e-5, fp32); a model family that ignores them is caught by the check the run makes at start."""
import pytest
import torch

from app.core import models, packing, tasks
from app.data import DataInfo, chat, text
from app.data.tokenizers import byte_tokenizer
from unit.test_data_chat import _rows


def test_blocks_hold_every_row_once_and_fill_up():
    lengths = [5, 3, 8, 2, 7, 1, 9, 4]
    blocks = chat.pack_order(lengths, 10)
    assert sorted(i for b in blocks for i in b) == list(range(8))
    assert all(sum(lengths[i] for i in b) <= 10 for b in blocks)
    assert len(blocks) == 4, "39 tokens in blocks of 10: four blocks"


def _first_fit(lengths, block):
    """First fit, longest first, by a scan of every block for each row: what pack_order must give."""
    blocks, room = [], []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        fit = next((b for b, left in enumerate(room) if left >= lengths[i]), None)
        if fit is None:
            blocks.append([i])
            room.append(block - lengths[i])
        else:
            blocks[fit].append(i)
            room[fit] -= lengths[i]
    return blocks


def test_the_blocks_are_first_fits_found_in_n_log_n():
    """The blocks a scan of all of them finds, rows longer than a block in one of their own; 200,000 rows (an
    UltraChat's) in seconds, where the scan took minutes."""
    import random
    import time
    rng = random.Random(0)
    for trial in range(200):
        block = rng.randint(1, 64)
        lengths = [rng.randint(1, block + 3 * (trial % 4 == 0)) for _ in range(rng.randint(0, 150))]
        assert chat.pack_order(lengths, block) == _first_fit(lengths, block), (lengths, block)
    lengths = [rng.randint(20, 2048) for _ in range(200_000)]
    start = time.perf_counter()
    blocks = chat.pack_order(lengths, 2048)
    assert time.perf_counter() - start < 20 and sorted(i for b in blocks for i in b) == list(range(200_000))


def packed_rows(tmp_path, block=128):
    tok = byte_tokenizer()
    chat.ensure_template(tok)
    encoded = text.instruction_rows(_rows(tmp_path), tok, "messages", block, False, "train")
    rows = chat.AnswerRows(encoded, tok.pad_token_id, max(len(ids) for ids in encoded["input_ids"]))
    return rows, chat.PackedRows(rows, block)


def test_a_block_is_its_rows_with_positions_restarting_and_their_answer_labels(tmp_path):
    rows, packed = packed_rows(tmp_path)
    (ids, positions), labels = packed[0]
    at = 0
    for index in packed.groups[0]:
        row = rows.dataset[index]
        n = len(row["input_ids"])
        assert torch.equal(ids[at:at + n], row["input_ids"]) and torch.equal(positions[at:at + n], torch.arange(n))
        assert labels[at] == chat.IGNORE and torch.equal(labels[at + 1:at + n], row["labels"][1:])
        at += n
    assert (labels[at:] == chat.IGNORE).all() and (at == packed.block or positions[at] == 0)
    assert packed.units[0] == int((labels != chat.IGNORE).sum()) == sum(rows.units[i] for i in packed.groups[0])
    assert sum(packed.units) == sum(rows.units) and len(packed) <= len(rows) / 3


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("preset", ["llama-tiny", "gpt2-tiny"])
def test_per_row_losses_packed_equal_unpacked(preset, attention, tmp_path):
    rows, packed = packed_rows(tmp_path)
    spec = models.hf_spec(preset)
    torch.manual_seed(0)
    info = DataInfo(0, task="causal_lm", vocab_size=258, seq_len=64, packed=True)
    model = models.build_hf(spec, info, byte_tokenizer(), {}, attention).eval()
    assert model.hf.config._attn_implementation == attention
    (ids, positions), labels = packed[0]
    with torch.no_grad():
        logits = model(ids[None], positions[None])[0]
        at = 0
        for index in packed.groups[0]:
            row_ids, row_labels = rows[index]
            n = len(rows.dataset[index]["input_ids"])
            alone = model(row_ids[None], torch.arange(len(row_ids))[None])[0]
            together = tasks.next_token_loss(logits[None, at:at + n], labels[None, at:at + n])
            apart = tasks.next_token_loss(alone[None], row_labels[None])
            assert torch.allclose(together, apart, atol=1e-5), (index, together, apart)
            at += n


def test_the_check_finds_a_family_whose_rows_leak_and_passes_one_whose_do_not():
    """OpenAI GPT builds its causal mask itself and ignores where rows start: packed rows see each other. (Llama
    with use_cache on would too: transformers skips the detection with a cache; the app builds models without.)"""
    from transformers import OpenAIGPTConfig, OpenAIGPTLMHeadModel, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    gpt = OpenAIGPTLMHeadModel(OpenAIGPTConfig(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, max_position_embeddings=32,
                                         use_cache=False)).eval()
    first, second = [5, 9, 3, 7, 11, 2], [4, 8, 6, 1]
    for model, leaks in ((gpt, True), (llama, False)):
        moved = packing.leak(lambda ids, pos: model(input_ids=ids, position_ids=pos).logits, first, second, (2, 16))
        assert (moved > 1e-3) == leaks, (type(model).__name__, moved)


def test_rows_and_real_tokens_per_sample_padded_and_packed(tmp_path):
    rows, packed = packed_rows(tmp_path)
    real = sum(len(ids) for ids in rows.dataset["input_ids"])
    assert rows.per_sample() == {"rows": 1.0, "real_tokens": pytest.approx(real / len(rows))}
    assert packed.per_sample() == {"rows": pytest.approx(len(rows) / len(packed)),
                                   "real_tokens": pytest.approx(real / len(packed))}
    assert sum(int((packed[i][0][0] != rows.pad_id).sum()) for i in range(len(packed))) >= real * 0.99


def test_a_leak_shows_through_a_padded_vocabularys_masked_columns():
    """A padded vocabulary's extra columns are -inf in both forwards (gpt2-124m's 50,257 of 50,304): a leak in the
    real columns is still seen, and an attention that keeps rows apart still moves nothing."""
    def forward(leaks):
        def run(ids, positions):
            logits = torch.nn.functional.one_hot(ids, 8).float()
            if leaks:
                logits = logits.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]  # a running mean
            return torch.cat([logits, torch.full((*ids.shape, 2), float("-inf"))], -1)
        return run
    first, second = [1, 2, 3], [4, 5]
    assert packing.leak(forward(True), first, second, (2, 8)) > 0.5
    assert packing.leak(forward(False), first, second, (2, 8)) == 0.0
