"""Tokenizers built locally: a byte-level one that round-trips any text, BPE trained on the data."""
from app.data import tokenizers
from conftest import sentences


def test_byte_tokenizer_round_trips_any_text():
    tokenizer = tokenizers.byte_tokenizer()
    sample = "héllo wörld ✓\n\ttabs and  spaces"
    ids = tokenizer(sample)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id and len(ids) == len(sample.encode()) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == sample
    assert len(tokenizer) == 258 and tokenizer.pad_token_id not in ids


def test_bpe_tokenizer_learns_merges_up_to_the_vocabulary():
    tokenizer = tokenizers.bpe_tokenizer(iter([[t for t, _ in sentences(300)]]), 300)
    assert 258 < len(tokenizer) <= 300
    sample = "the happy dog chases the owl ."
    ids = tokenizer(sample, add_special_tokens=False)["input_ids"]
    assert len(ids) < len(sample) / 2 and tokenizer.decode(ids) == sample


def test_the_tokenizer_choice(tmp_path, capsys):
    """'' without a model folder and 'bytes' build the byte-level one; a saved folder loads; 'bpe' trains."""
    assert len(tokenizers.build_tokenizer("", "", 8192, None)) == 258
    assert len(tokenizers.build_tokenizer("bytes", "gpt2-anything", 8192, None)) == 258
    bpe = tokenizers.build_tokenizer("bpe", "", 300, iter([[t for t, _ in sentences(300)]]))
    assert 258 < len(bpe) <= 300
    bpe.save_pretrained(tmp_path / "saved")
    loaded = tokenizers.build_tokenizer(str(tmp_path / "saved"), "", 8192, None)
    assert loaded("the owl")["input_ids"] == bpe("the owl")["input_ids"]
    (tmp_path / "model-only").mkdir()  # a model folder saved without its tokenizer
    assert len(tokenizers.build_tokenizer("", str(tmp_path / "model-only"), 8192, None)) == 258
    assert "tokenizer: none in" in capsys.readouterr().out
