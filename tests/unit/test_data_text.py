"""Text data: every file format, column choice, blocks that cover the text once, a reused cache, labels, and the
tasks that refuse preference pairs."""
import json

import datasets
import pytest

from app.data import chat, text
from app.data.tokenizers import byte_tokenizer
from app.errors import UserError
from app.settings import Settings
from conftest import REPO, sentences, started_tokenizer, write_text_rows

FORMATS = [".txt", ".json", ".jsonl", ".csv", ".parquet"]


@pytest.mark.parametrize("suffix", FORMATS)
def test_every_file_format_loads_with_a_held_out_share(suffix, tmp_path):
    path = write_text_rows(tmp_path / f"data{suffix}", 50, labelled=suffix != ".txt")
    train, held = text.load_splits(str(path), "", "", 0.2, seed=0)
    assert (len(train), len(held)) == (40, 10)
    assert sorted(list(train["text"]) + list(held["text"])) == sorted(t for t, _ in sentences(50))
    if suffix != ".txt":
        assert sorted(list(train["label"]) + list(held["label"])) == sorted(y for _, y in sentences(50))


def test_compressed_files_other_cases_of_suffix_and_ndjson_load_as_their_kind(tmp_path):
    """datasets reads a .jsonl.gz (or .bz2, .xz, .zst) through its compression; a suffix's case is no kind."""
    import gzip
    plain = write_text_rows(tmp_path / "rows.jsonl", 50)
    folder = tmp_path / "shards"
    folder.mkdir()
    (folder / "part-0.JSONL.gz").write_bytes(gzip.compress(plain.read_bytes()))
    (folder / "part-1.ndjson").write_bytes(plain.read_bytes())
    train, held = text.load_splits(str(folder), "", "", 0.2, seed=0)
    assert (len(train), len(held)) == (80, 20)
    assert sorted(list(train["text"]) + list(held["text"])) == sorted(2 * [t for t, _ in sentences(50)])


def test_a_folder_datasets_save_to_disk_wrote_loads_its_splits(tmp_path):
    """Read with load_from_disk, not as the JSON files of its metadata; a Dataset's folder is one training set."""
    rows = [{"text": t, "label": y} for t, y in sentences(30)]
    dataset = datasets.Dataset.from_list(rows)
    datasets.DatasetDict(train=dataset.select(range(24)), validation=dataset.select(range(24, 30))).save_to_disk(
        str(tmp_path / "dict"))
    dataset.save_to_disk(str(tmp_path / "one"))
    train, held = text.load_splits(str(tmp_path / "dict"), "", "", 0.5, seed=0)
    assert (len(train), len(held)) == (24, 6) and list(held["text"]) == [t for t, _ in sentences(30)][24:]
    train, held = text.load_splits(str(tmp_path / "one"), "", "", 0.2, seed=0)
    assert (len(train), len(held)) == (24, 6) and set(train.column_names) == {"text", "label"}
    from app.data import stream
    with pytest.raises(UserError, match="is a folder datasets' save_to_disk wrote, which loads whole: pass "
                                        "--streaming off"):
        next(stream.read_rows(str(tmp_path / "one"), "", 0, 0, 0))


def test_a_folder_of_files_and_an_eval_file(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    write_text_rows(folder / "a.jsonl", 30, seed=1)
    write_text_rows(folder / "b.jsonl", 20, seed=2)
    held_file = write_text_rows(tmp_path / "held.jsonl", 7, seed=3)
    train, held = text.load_splits(str(folder), "", str(held_file), 0.5, seed=0)
    assert (len(train), len(held)) == (50, 7)
    with pytest.raises(UserError, match="need files of one kind"):
        text.load_splits(str(folder), "", str(write_text_rows(tmp_path / "held.csv", 5)), 0.1, seed=0)


def test_the_dataset_file_named_again_as_eval_file_trains_and_evaluates_on_it(tmp_path):
    """Named twice, one file is both splits, as asked; in a folder, the eval file is held out of the training
    files, and a folder of it alone has none to train on: one line each."""
    path = write_text_rows(tmp_path / "rows.jsonl", 9)
    train, held = text.load_splits(str(path), "", str(path), 0.5, seed=0)
    assert len(train) == len(held) == 9 and list(train["text"]) == list(held["text"])
    (tmp_path / "only").mkdir()
    inside = write_text_rows(tmp_path / "only" / "held.jsonl", 5)
    with pytest.raises(UserError, match=rf"^--dataset {tmp_path / 'only'} holds no data file \(.txt, .text, .json, "
                                        rf".jsonl, .ndjson, .csv, .parquet\) besides --eval_file {inside}$"):
        text.load_splits(str(tmp_path / "only"), "", str(inside), 0.5, seed=0)
    (tmp_path / "none-here").mkdir()
    with pytest.raises(UserError, match=rf"^--dataset {tmp_path / 'none-here'} holds no data file \(.txt, "):
        text.load_splits(str(tmp_path / "none-here"), "", "", 0.5, seed=0)


UF_CARD = """---
license: mit
configs:
- config_name: default
  data_files:
  - split: train_prefs
    path: data/train_prefs-*
  - split: test_prefs
    path: data/test_prefs-*
  - split: train_sft
    path: data/train_sft-*
---
# A dataset saved from the hub: its card names the splits
"""


def test_a_folder_saved_from_the_hub_trains_on_its_train_split_alone(tmp_path):
    """Files named by split (data/train-*, data/test-*, as the hub keeps them) are those splits, not one training
    set; a plain folder stays one; the streamed rows are the training split's too."""
    from app.data import stream
    (tmp_path / "saved" / "data").mkdir(parents=True)
    write_text_rows(tmp_path / "saved" / "data" / "train-00000-of-00001.jsonl", 30, seed=1)
    write_text_rows(tmp_path / "saved" / "data" / "test-00000-of-00001.jsonl", 6, seed=2)
    train, held = text.load_splits(str(tmp_path / "saved"), "", "", 0.5, seed=0)
    assert (len(train), len(held)) == (30, 6)
    assert sorted(train["text"]) == sorted(t for t, _ in sentences(30, 1))
    assert sorted(held["text"]) == sorted(t for t, _ in sentences(6, 2))
    streamed = [row["text"] for row in stream.read_rows(str(tmp_path / "saved"), "", 0, 0, 0)]
    assert sorted(streamed) == sorted(train["text"])
    assert text.names_splits(tmp_path / "saved")


@pytest.mark.parametrize("names, eval_name", [(("rows.jsonl", "test_data.jsonl"), ""),  # no train split named
                                              (("train.jsonl", "test.jsonl"), "test.jsonl"),  # held out by hand
                                              (("train-0.jsonl", "train-1.jsonl"), "")])  # one split alone
def test_a_folder_whose_names_do_not_name_splits_stays_one_training_set(tmp_path, names, eval_name):
    """Only a folder whose data files' names claim a train split and another, the --eval_file not one of them, is
    read split by split; any other is every file's rows, less the --eval_file."""
    for i, name in enumerate(names):
        write_text_rows(tmp_path / name, 5 + i, seed=i)
    eval_file = str(tmp_path / eval_name) if eval_name else ""
    assert not text.names_splits(tmp_path, eval_file)
    train, held = text.load_splits(str(tmp_path), "", eval_file, 0.2, seed=0, hold_out=bool(eval_file))
    kept = [5 + i for i, name in enumerate(names) if name != eval_name]
    assert len(train) == sum(kept) and (held is None) == (not eval_file)


def test_a_file_no_split_claims_is_left_out_and_said_not_the_test_split_trained_on(tmp_path, capsys):
    """imdb's plain_text folder (train-*, test-*, unsupervised-*): read as datasets reads it, the test rows held
    out; the file no split's name claims is left out, in a line (the whole folder was one training set, test rows
    and all)."""
    for name, rows in (("train-00000-of-00001.jsonl", 12), ("test-00000-of-00001.jsonl", 4),
                       ("unsupervised-00000-of-00001.jsonl", 7)):
        write_text_rows(tmp_path / name, rows, seed=rows)
    assert text.names_splits(tmp_path) and text.unclaimed(tmp_path) == ["unsupervised-00000-of-00001.jsonl"]
    train, held = text.load_splits(str(tmp_path), "", "", 0.5, seed=0)
    assert (len(train), len(held)) == (12, 4)
    assert "left out, as no split's name claims them: unsupervised-00000-of-00001.jsonl" in capsys.readouterr().out


def test_a_streamed_folder_that_names_its_splits_holds_out_its_test_split(tmp_path):
    """A streamed run reads the training split's rows and evaluates on the folder's own test split (or the one
    --dataset_test_split names), as a loaded run does."""
    from app.data import stream
    (tmp_path / "data").mkdir()
    write_text_rows(tmp_path / "data" / "train-00000-of-00001.jsonl", 30, seed=1)
    write_text_rows(tmp_path / "data" / "test-00000-of-00001.jsonl", 6, seed=2)
    settings = Settings(model="llama-tiny", dataset=str(tmp_path), streaming="on", max_steps=2)
    assert sorted(stream._held_out(settings, str(tmp_path))["text"]) == sorted(t for t, _ in sentences(6, 2))
    with pytest.raises(UserError, match=rf"^--dataset {tmp_path} has no split 'dev'; its splits are train, test"):
        stream._held_out(Settings(model="llama-tiny", dataset=str(tmp_path), streaming="on", max_steps=2,
                                  dataset_test_split="dev"), str(tmp_path))
    with pytest.raises(UserError, match="has no split 'train_sft'; its splits are train, test: pass "
                                        "--dataset_train_split"):
        list(stream.read_rows(str(tmp_path), "", 0, 0, 0, "train_sft"))


def test_splits_a_dataset_card_names_are_picked_by_flag_and_a_missing_one_lists_them(tmp_path):
    """UltraFeedback's card names train_prefs, test_prefs and train_sft (here over files whose names name no split:
    the card alone says what each holds): no split is 'train', so the run says which there are;
    --dataset_train_split and --dataset_test_split pick them. A card without a YAML header names nothing."""
    folder = tmp_path / "ultrafeedback"
    (folder / "data").mkdir(parents=True)
    (folder / "README.md").write_text(UF_CARD.replace("/train_prefs-*", "/prefs-a*").replace("/test_prefs-*",
                                                                                           "/prefs-b*"))
    for name, rows in (("prefs-a", 12), ("prefs-b", 4), ("train_sft", 9)):
        write_text_rows(folder / "data" / f"{name}-00000-of-00001.jsonl", rows, seed=rows)
    assert text.names_splits(folder)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "README.md").write_text("# Notes\nconfigs: none here\n---\n")
    write_text_rows(tmp_path / "plain" / "rows.jsonl", 5)
    assert not text.names_splits(tmp_path / "plain")
    with pytest.raises(UserError, match=rf"^--dataset {folder} has no split 'train'; its splits are train_prefs, "
                                        r"test_prefs, train_sft: pass --dataset_train_split with one of them$"):
        text.load_splits(str(folder), "", "", 0.5, seed=0)
    train, held = text.load_splits(str(folder), "", "", 0.5, seed=0, splits_named=("train_prefs", "test_prefs"))
    assert (len(train), len(held)) == (12, 4)
    train, held = text.load_splits(str(folder), "", "", 0.25, seed=0, splits_named=("train_sft", ""))
    assert (len(train), len(held)) == (6, 3), "no validation nor test split: --eval_fraction of the training rows"
    with pytest.raises(UserError, match="no split 'dev'; its splits are train_prefs, test_prefs, train_sft: pass "
                                        "--dataset_test_split"):
        text.load_splits(str(folder), "", "", 0.5, seed=0, splits_named=("train_prefs", "dev"))
    eval_file = write_text_rows(tmp_path / "held.jsonl", 3)
    assert len(text.load_splits(str(folder), "", str(eval_file), 0.5, 0, splits_named=("train_prefs", ""))[1]) == 3


def test_columns_default_sensibly_and_a_wrong_name_lists_the_real_ones(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"sentence": t, "label": y, "id": i}) + "\n"
                            for i, (t, y) in enumerate(sentences(20))))
    train, _ = text.load_splits(str(path), "", "", 0.1, seed=0)
    assert text.pick_column(train, "", "text", ("text",)) == "sentence"  # the only string column
    assert text.pick_column(train, "", "label", ("label", "labels")) == "label"
    with pytest.raises(UserError, match=r"--text_column 'body' is not in the dataset; its columns are: sentence, label, id"):
        text.pick_column(train, "body", "text", ("text",))
    two = train.add_column("title", ["x"] * len(train))
    with pytest.raises(UserError, match="cannot tell which column holds the text; pass --text_column"):
        text.pick_column(two, "", "text", ("text",))


def test_an_empty_file_is_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(UserError, match="no training rows"):
        text.load_splits(str(tmp_path / "empty.txt"), "", "", 0.1, seed=0)


def test_each_text_of_the_blocks_opens_with_the_start_token_streamed_or_not(tmp_path):
    from app.data import stream
    dataset = datasets.Dataset.from_dict({"text": ["ab", "cd", "ef"]})
    tokenizer = started_tokenizer()
    blocks = text.lm_blocks(dataset, tokenizer, "text", 4, "train")
    assert [tokenizer.decode(b) for b in blocks["input_ids"]] == ["<s>ab</s>", "<s>cd</s>", "<s>ef</s>"]
    made = stream.Stream.__new__(stream.Stream)
    made.tokenizer, made.column, made.block = tokenizer, "text", 4
    assert [tokenizer.decode(ids) for ids, _, _ in made._blocks(iter(dataset))] == ["<s>ab</s>", "<s>cd</s>",
                                                                                   "<s>ef</s>"]


def test_blocks_are_the_concatenated_text_cut_once_and_the_cache_is_reused(tmp_path, capsys):
    train, _ = text.load_splits(str(write_text_rows(tmp_path / "c.txt", 200)), "", "", 0.1, seed=0)
    tokenizer = byte_tokenizer()
    blocks = text.lm_blocks(train, tokenizer, "text", 16, "train")
    assert "train: " in capsys.readouterr().out
    flat = [t for s in list(train["text"]) for t in tokenizer(s, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]]
    assert [t for block in list(blocks["input_ids"]) for t in block] == flat[:len(flat) // 16 * 16]
    assert all(len(block) == 16 for block in list(blocks["input_ids"]))
    again = text.lm_blocks(train, tokenizer, "text", 16, "train")
    assert "reused the tokenized cache" in capsys.readouterr().out and list(again["input_ids"]) == list(blocks["input_ids"])
    text.lm_blocks(train, tokenizer, "text", 8, "train")  # another block size is another cache entry
    assert "(tokenized)" in capsys.readouterr().out


def test_the_held_out_split_is_never_the_training_one():
    """A hub dataset with a test split alone (many evaluation sets), trained on with --dataset_train_split test:
    its held-out rows come from --eval_fraction, not from the rows it trains on."""
    splits = datasets.DatasetDict(test=datasets.Dataset.from_dict({"text": [f"row {i}" for i in range(10)]}),
                                  validation=datasets.Dataset.from_dict({"text": ["v"]}))
    train, held = text.picked(splits, "src", "validation", "")
    assert (len(train), len(held)) == (1, 10), "trained on validation: held out on test"
    train, held = text.picked(datasets.DatasetDict(test=splits["test"]), "src", "test", "")
    assert len(train) == 10 and held is None
    with pytest.raises(UserError, match="--dataset_test_split test is the training split too"):
        text.picked(splits, "src", "test", "test")
