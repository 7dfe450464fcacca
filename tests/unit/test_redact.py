"""Which names look like secrets, and copies of a dict with their values hidden at any depth."""
import json

import pytest

from app.redact import REDACTED, looks_secret, redacted


@pytest.mark.parametrize("name", ["APITOKEN", "ACCESSTOKEN", "GITHUB_ACCESSTOKEN", "hf-token", "auth.token",
                                  "DB_PASSWD", "client_secret", "MyApiKey_apikey", "private_key", "ssh_keys",
                                  "sort_keys_first", "aws_session_token", "Comet.Api.Key"])
def test_a_word_of_the_name_that_says_secret_makes_it_one(name):
    assert looks_secret(name)


@pytest.mark.parametrize("name", ["TOKENIZERS_PARALLELISM", "NCCL_IB_PKEY", "PYTHON_KEYRING_BACKEND", "max_tokens",
                                  "keyboard_layout", "monkey", "tokenizer", "SSH_KEYFILE", "",
                                  "__", "train_micro_batch_size_per_gpu"])
def test_a_name_that_only_contains_a_secret_word_inside_another_is_not_one(name):
    assert not looks_secret(name)


def test_a_monitors_key_is_hidden_at_any_depth_and_the_rest_is_kept():
    config = {"train_micro_batch_size_per_gpu": 4,
              "comet": {"enabled": True, "api_key": "c0mEt", "project": "p"},
              "monitors": [{"wandb": {"token": "w4nDb", "team": "t"}}, {"csv": {"output_path": "runs/"}}],
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.9, 0.999]}}}
    before = json.dumps(config)
    hidden = redacted(config)
    assert hidden["comet"] == {"enabled": True, "api_key": REDACTED, "project": "p"}
    assert hidden["monitors"] == [{"wandb": {"token": REDACTED, "team": "t"}}, {"csv": {"output_path": "runs/"}}]
    assert hidden["optimizer"] == config["optimizer"] and hidden["train_micro_batch_size_per_gpu"] == 4
    assert "c0mEt" not in json.dumps(hidden) and "w4nDb" not in json.dumps(hidden)
    assert json.dumps(config) == before, "the dict the engine was given is untouched"


def test_an_unset_secret_stays_visibly_unset():
    """An empty string, None or a number under a secret-looking key says the secret was not given: kept, so a user
    reading the saved dict sees it was never set."""
    assert redacted({"api_key": "", "token": None, "password": 0}) == {"api_key": "", "token": None, "password": 0}


def test_keys_that_are_not_strings_and_values_that_are_not_containers_pass_through():
    assert redacted({1: "one", ("a", "b"): "pair", "passwd": "x"}) == {1: "one", ("a", "b"): "pair",
                                                                       "passwd": REDACTED}
    assert redacted("HF_TOKEN") == "HF_TOKEN" and redacted(3.5) == 3.5 and redacted(None) is None
    assert redacted([{"secret": "s"}, "token"]) == [{"secret": REDACTED}, "token"]


def test_a_list_or_dict_under_a_secret_looking_key_is_hidden_whole_and_a_number_is_not():
    hidden = redacted({"api_keys": ["sk-live-1", "sk-live-2"], "secret": {"value": "abc"}, "pad_token_id": 50256,
                       "tokens": []})
    assert hidden == {"api_keys": REDACTED, "secret": REDACTED, "pad_token_id": 50256, "tokens": []}


def test_a_urls_password_is_hidden_in_any_string_and_its_user_kept():
    """MLflow's postgresql://user:password@host/db, a dataset's https://user:token@host/...; ssh://git@host has
    no password, and a path holding "key" is no secret."""
    from app.redact import has_password, without_password
    said = redacted({"dataset": "https://ana:hf_tok@data.example/rows.jsonl", "uri": ["postgresql://a:b@db/x"],
                     "output_dir": "/home/keys/run", "repo": "ssh://git@github.com/x"})
    assert said == {"dataset": "https://ana:<redacted>@data.example/rows.jsonl",
                    "uri": ["postgresql://a:<redacted>@db/x"], "output_dir": "/home/keys/run",
                    "repo": "ssh://git@github.com/x"}
    assert has_password("mysql+pymysql://u:p@h/d") and not has_password("http://h:5000/x")
    assert without_password("see http://u:p@h and https://v:q@k/") == \
        "see http://u:<redacted>@h and https://v:<redacted>@k/"
