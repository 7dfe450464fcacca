"""Labelled text: the classes of a label column of each kind and their names, a pretrained head's order, sentence
pairs, unlabelled rows, and the one-line refusals of labels that are not one class a row."""
import datasets
import pytest

from app.data import labels, text
from app.data.tokenizers import byte_tokenizer
from app.errors import UserError

GLUE = datasets.Features({"sentence1": datasets.Value("string"), "sentence2": datasets.Value("string"),
                          "label": datasets.ClassLabel(names=["entailment", "not_entailment"])})


def _rows(**columns):
    return datasets.Dataset.from_dict(columns)


def test_labels_of_any_kind_map_to_class_indices(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("text,label\nfine day,good\nawful day,bad\nnice one,good\n")
    train, _ = text.load_splits(str(path), "", "", 0.1, seed=0)
    names = labels.label_names(train, "label")
    assert names == sorted(set(list(train["label"])))
    rows = labels.labelled_rows(train, byte_tokenizer(), "text", "label", names, 4, "train")
    assert list(rows["target"]) == [names.index(y) for y in list(train["label"])]
    assert all(len(ids) == 4 for ids in list(rows["input_ids"]))  # truncated to the block size
    with pytest.raises(UserError, match="the held-out label 'meh' never occurs"):
        held = train.map(lambda row: {"label": "meh"})
        labels.labelled_rows(held, byte_tokenizer(), "text", "label", names, 4, "held-out")
    held = datasets.Dataset.from_dict({"text": ["fine day", "no label"], "label": ["good", None]})  # one left empty
    with pytest.raises(UserError, match="--label_column 'label' of the held-out rows holds empty values"):
        labels.labelled_rows(held, byte_tokenizer(), "text", "label", names, 4, "held-out")


def test_whole_numbers_of_any_sign_are_classes_and_scores_several_labels_or_kinds_are_one_line():
    assert labels.label_names(_rows(label=[1.0, 0.0, 2.0]), "label") == [0, 1, 2], "a CSV's 1.0 is class 1"
    assert labels.label_names(_rows(label=[-1, 1, 0]), "label") == [-1, 0, 1], "-1/0/1 sentiment: three classes"
    with pytest.raises(UserError, match=r"holds scores such as 3.8, a regression target"):
        labels.label_names(_rows(label=[0.0, 3.8, 5.0]), "label")  # STS-B's similarity scores
    with pytest.raises(UserError, match="several labels a row"):
        labels.label_names(_rows(labels=[[0, 3], [1]]), "labels")  # go_emotions' multi-label rows
    with pytest.raises(UserError, match="labels differ in kind: numbers in one, names in another"):
        labels.classes([_rows(label=[0, 1]), _rows(label=["neg", "pos"])], ["label", "label"])


def test_labelled_sources_must_agree_on_their_class_names():
    one = datasets.Dataset.from_dict({"text": ["a", "b"], "label": [0, 1]},
                                     features=datasets.Features({"text": datasets.Value("string"),
                                                                 "label": datasets.ClassLabel(names=["neg", "pos"])}))
    other = _rows(text=["c", "d"], labels=["pos", "neg"])
    with pytest.raises(UserError, match="labels differ in kind or order \\(ClassLabel names: neg, pos; plain values"):
        labels.classes([one, other], ["label", "labels"])
    assert labels.classes([other, other], ["labels", "labels"]) == (["neg", "pos"], ["neg", "pos"])
    assert labels.classes([one, one], ["label", "label"]) == ([0, 1], ["neg", "pos"]), "a ClassLabel's names"


def test_a_pretrained_heads_names_set_the_order_of_the_classes():
    """roberta-large-mnli's head names its rows CONTRADICTION, NEUTRAL, ENTAILMENT; GLUE's MNLI numbers them
    entailment, neutral, contradiction: each class goes to the row trained for it, as run_glue maps them."""
    from transformers import RobertaConfig
    head = labels.head_names(RobertaConfig(id2label={0: "CONTRADICTION", 1: "NEUTRAL", 2: "ENTAILMENT"}), "m")
    assert head == ("CONTRADICTION", "NEUTRAL", "ENTAILMENT")
    assert labels.head_names(RobertaConfig(num_labels=3), "m") == (), "transformers' LABEL_0... name nothing"
    assert labels.head_names(RobertaConfig(id2label={0: "neg", 1: "pos"}), "") == (), "a preset has no head"
    mnli = ([0, 1, 2], ["entailment", "neutral", "contradiction"])
    assert labels.in_head_order(*mnli, head) == ([2, 1, 0], ["contradiction", "neutral", "entailment"])
    assert labels.in_head_order(*mnli, ("a", "b", "c")) == mnli


def test_sentence_pairs_are_read_both_and_unlabelled_rows_left_out(capsys):
    """RTE's layout: sentence1 and sentence2 with a ClassLabel, -1 where a row has no label (SNLI's, a test split's)."""
    rows = datasets.Dataset.from_dict({"sentence1": ["ab", "cd", "ef"], "sentence2": ["xy", "zw", "uv"],
                                       "label": [0, -1, 1]}, features=GLUE)
    assert labels.text_columns(rows, "") == "sentence1,sentence2"
    assert labels.text_columns(rows, "sentence2") == "sentence2"
    with pytest.raises(UserError, match="--text_column 'premise' is not in the dataset"):
        labels.text_columns(rows, "premise,hypothesis")
    for wrong in ("sentence1,sentence2,label", "sentence1,", ",sentence1"):  # a stray comma names no column
        with pytest.raises(UserError, match="one text a row or a pair of them"):
            labels.text_columns(rows, wrong)
    tokenizer = byte_tokenizer()
    encoded = labels.labelled_rows(rows, tokenizer, "sentence1,sentence2", "label", [0, 1], 64, "train")
    assert list(encoded["target"]) == [0, 1]
    assert [tokenizer.decode(ids) for ids in encoded["input_ids"]] == [tokenizer.decode(tokenizer("ab", "xy")[
        "input_ids"]), tokenizer.decode(tokenizer("ef", "uv")["input_ids"])]
    assert "xy" in tokenizer.decode(encoded["input_ids"][0])
    assert "train: 1 rows have no label (-1) and are left out" in capsys.readouterr().out
    with pytest.raises(UserError, match="no held-out row has a label"):
        labels.labelled_rows(rows.select([1]), tokenizer, "sentence1,sentence2", "label", [0, 1], 64, "held-out")
