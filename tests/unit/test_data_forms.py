"""What a text source's rows hold and the block they are cut to (app/data/forms.py), as loaded and streamed sets
both read them. Preference pairs' forms: tests/unit/test_data_preference.py."""
import datasets
import pytest

from app.data import TextModel, forms
from app.data.tokenizers import byte_tokenizer
from app.errors import UserError
from app.settings import Settings


def test_instruction_data_has_its_form_and_plain_text_none():
    chats = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "a"}]}])
    plain = datasets.Dataset.from_list([{"text": "a"}])
    settings = Settings(model="llama-tiny", dataset="rows.jsonl")
    assert forms.instruction_form(chats, "causal_lm", settings) == "messages"
    assert forms.instruction_form(plain, "causal_lm", settings) == ""
    assert forms.instruction_form(chats, "sequence_classification", settings) == "", "labelled text: no form"
    with pytest.raises(UserError, match="--task instruction needs rows with a 'messages' column.*rows.jsonl has: "
                                        "text$"):
        forms.instruction_form(plain, "instruction", settings)


def test_the_block_is_the_models_positions_at_most():
    tokenizer, model = byte_tokenizer(), TextModel("", 8192, 128)
    assert forms.block_for(Settings(model="llama-tiny"), model, tokenizer) == 128
    assert forms.block_for(Settings(model="llama-tiny", block_size=64), model, tokenizer) == 64
    assert forms.block_for(Settings(model="llama-tiny"), TextModel("", 8192, 4096), tokenizer) == 1024
    with pytest.raises(UserError, match="--block_size 256 is longer than llama-tiny's 128 positions"):
        forms.block_for(Settings(model="llama-tiny", block_size=256), model, tokenizer)
    with pytest.raises(UserError, match=f"the tokenizer has {len(tokenizer)} tokens but llama-tiny embeds only 100"):
        forms.block_for(Settings(model="llama-tiny"), TextModel("", 100, 128), tokenizer)


def test_the_sources_make_one_kind_together():
    assert forms.kind_of(["messages", "alpaca"], ["a", "b"], "causal_lm") == "instruction"
    assert forms.kind_of(["explicit", "implicit"], ["a", "b"], "causal_lm") == "preference"
    assert forms.kind_of(["", ""], ["a", "b"], "sequence_classification") == "sequence_classification"
    with pytest.raises(UserError, match="different kinds of rows \\(a: text, --eval_file: preference pairs\\)"):
        forms.kind_of(["", "explicit"], ["a"], "causal_lm")
