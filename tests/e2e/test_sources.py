"""Several training sources end to end (docs/data-and-models.md, "Several datasets"): chats and Alpaca rows mixed 1:3
on 2 ranks, each epoch drawn anew; the share each source gave; a resume mid-epoch, on the same and on another world
size, takes the same rows and losses; each source's evaluation is its held-out set evaluated alone, and the combined
row their mean; preference pairs and plain text mix too; sources of different kinds are refused in one line."""
import json

import pytest

from conftest import REPO, assert_one_error_line, read_metrics, read_summary, train_jobs, write_text_rows

STEPS, EPOCH = 16, 14  # 420 rows an epoch, 32 a step: epoch 0 ends at step 14, its last micro batch padded


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from app.tools.instructions import write, write_model, write_pairs
    tmp = tmp_path_factory.mktemp("sources")
    model = write_model(tmp / "model", seed=0)
    chats, held_chats = write(tmp / "chats", 300, seed=0), write(tmp / "held-chats", 40, seed=1)
    alpaca, held_alpaca = tmp / "alpaca.jsonl", tmp / "held-alpaca.jsonl"
    for path, first, count in ((alpaca, 0, 120), (held_alpaca, 500, 30)):
        path.write_text("".join(json.dumps({"instruction": f"Add {i} and {i + 1}.", "input": "",
                                            "output": str(2 * i + 1)}) + "\n" for i in range(first, first + count)))
    config = json.loads((REPO / "ds_configs" / "dp.json").read_text())
    config.pop("gradient_accumulation_steps")  # 32 a step on 1 rank and on 2
    (tmp / "ds.json").write_text(json.dumps({**config, "train_batch_size": 32, "train_micro_batch_size_per_gpu": 16}))
    base = ["--model", model, "--block_size", 128, "--eval_answers", 0, "--deepspeed_config", tmp / "ds.json",
            "--log_interval", 1]
    mixed = [*base, "--dataset", f"{chats},{alpaca}", "--mix_weights", "1,3", "--eval_file",
             f"{held_chats},{held_alpaca}", "--eval_interval", 8]
    two = {"straight": [*mixed, "--max_steps", STEPS], "stopped": [*mixed, "--max_steps", 7],
           "resumed": {"argv": [*mixed, "--max_steps", STEPS, "--resume", "auto"], "folder": "stopped"},
           "stopped on 2 ranks": [*mixed, "--max_steps", 7],
           "one held-out set": [*base, "--dataset", f"{chats},{alpaca}", "--mix_weights", "1,3", "--eval_file",
                                held_alpaca, "--max_steps", 8, "--eval_interval", 8],
           "pairs": [*base, "--dataset", f"{write_pairs(tmp / 'pairs', 300, seed=0)},"
                                         f"{REPO / 'tests/data/preference/trl-zen-standard_implicit.jsonl'}",
                     "--mix_weights", "1,1", "--max_steps", 3, "--eval_interval", 3],
           "text": [*base, "--dataset", f"{write_text_rows(tmp / 'one.txt', 400)},"
                                        f"{write_text_rows(tmp / 'two.txt', 100, seed=1)}",
                    "--mix_weights", "1,1", "--mix_by", "tokens", "--max_steps", 3, "--eval_interval", 3],
           "packed": [*base, "--dataset", f"{chats},{alpaca}", "--max_steps", 2, "--eval_interval", 2],
           "kinds": [*base, "--dataset", f"{chats},{tmp / 'pairs' / 'pairs.jsonl'}", "--max_steps", 1]}
    one = {"other world size": {"argv": [*mixed, "--max_steps", STEPS, "--resume", "auto"],
                                "folder": "stopped on 2 ranks"}}
    refused = {"kinds"}

    def folder(name, job):
        return tmp / (job.get("folder", name) if isinstance(job, dict) else name).replace(" ", "-")

    def argv(name, job):
        given = job if isinstance(job, dict) else {"argv": job}
        return [*given["argv"], "--output_dir", folder(name, job)]
    outputs = train_jobs("ranks", 2, [argv(n, j) for n, j in two.items()], codes=[2 if n in refused else 0 for n in two])
    outputs += train_jobs("python", 1, [argv(n, j) for n, j in one.items()])
    return {name: (folder(name, job), output) for (name, job), output in zip([*two.items(), *one.items()], outputs)}


def test_each_epoch_draws_the_weighted_share_of_each_source(runs):
    folder, output = runs["straight"]
    assert "mix by rows: rows an epoch from chats 105 of its 300 (sampled); alpaca 315 of its 120 (repeated, 2.6x)" \
        in output
    train, _ = read_metrics(folder)
    at = {row["step"]: row for row in train}
    assert (at[EPOCH]["rows/chats"], at[EPOCH]["rows/alpaca"]) == (105, 315)  # a whole epoch: exactly its share
    last = at[STEPS]
    assert last["rows/chats"] + last["rows/alpaca"] == 420 + (STEPS - EPOCH) * 32
    assert abs(last["rows/alpaca"] / (last["rows/chats"] + last["rows/alpaca"]) - 0.75) < 0.05
    assert last["tokens/chats"] > last["rows/chats"] and last["tokens/alpaca"] > last["rows/alpaca"]
    summary = read_summary(folder)
    assert (summary["rows/chats"], summary["tokens/alpaca"]) == (last["rows/chats"], last["tokens/alpaca"])


def test_a_resume_mid_epoch_takes_the_same_rows_also_on_another_world_size(runs):
    straight = read_metrics(runs["straight"][0])[0]
    for name in ("resumed", "other world size"):
        resumed = read_metrics(runs[name][0])[0]
        assert [r["step"] for r in resumed] == list(range(1, STEPS + 1)), name
        assert "resume: " in runs[name][1] and "at step 7, epoch 0, batch 7" in runs[name][1], name
        # on 1 rank (16 rows a micro batch) epoch 0's last micro batch is padded to 16 rows, not 32: from the epoch's
        # end on, the same global order falls into the steps differently
        same = STEPS if name == "resumed" else EPOCH - 1
        for a, b in zip(straight[:same], resumed[:same]):
            assert all(a[k] == b[k] for k in a if k.startswith(("rows/", "tokens/"))), (name, a, b)
        assert max(abs(a["loss"] - b["loss"]) for a, b in zip(straight[:same], resumed[:same])) < \
            (1e-6 if name == "resumed" else 1e-4), name


def test_each_sources_evaluation_is_its_held_out_set_alone_and_the_combined_row_their_mean(runs):
    _, held = read_metrics(runs["straight"][0])
    alone = read_metrics(runs["one held-out set"][0])[1]
    assert alone[0]["step"] == held[0]["step"] == 8
    assert abs(alone[0]["eval_loss"] - held[0]["eval_loss/alpaca"]) < 1e-6
    assert "eval_loss/alpaca" not in alone[0] or alone[0]["eval_loss/alpaca"] is None
    row = held[-1]
    parts = [(row[f"eval_loss/{n}"], row[f"eval_accuracy/{n}"]) for n in ("chats", "alpaca")]
    assert min(p[0] for p in parts) <= row["eval_loss"] <= max(p[0] for p in parts)
    import math
    assert abs(row["eval_perplexity"] - math.exp(row["eval_loss"])) < 1e-6 * row["eval_perplexity"]
    assert abs(read_summary(runs["straight"][0])["eval_loss/chats"] - row["eval_loss/chats"]) < 1e-6


def test_preference_pairs_and_plain_text_mix_too(runs):
    _, held = read_metrics(runs["pairs"][0])
    names = ("pairs", "trl-zen-standard_implicit")
    assert all(held[-1][f"eval_reward_accuracy/{n}"] is not None for n in names)
    train = read_metrics(runs["pairs"][0])[0]
    assert train[-1]["rows/pairs"] + train[-1]["rows/trl-zen-standard_implicit"] == 3 * 32
    folder, output = runs["text"]
    assert "mix by tokens" in output
    train, held = read_metrics(folder)
    assert train[-1]["tokens/one"] == train[-1]["rows/one"] * 128 and held[-1]["eval_perplexity/two"] > 1


def test_packed_blocks_count_the_rows_of_each_source_they_hold(runs):
    folder, output = runs["packed"]
    assert "packing: 378 rows into" in output  # 10% of each source held out
    train, held = read_metrics(folder)
    rows, tokens = train[-1]["rows/chats"] + train[-1]["rows/alpaca"], train[-1]["tokens/chats"] + \
        train[-1]["tokens/alpaca"]
    assert rows > 2 * 32 and tokens <= 2 * 32 * 128  # 32 blocks a step, each of several rows
    assert held[-1]["eval_loss/chats"] is not None and held[-1]["eval_loss/alpaca"] is not None


def test_sources_of_different_kinds_are_refused_in_one_line(runs):
    assert_one_error_line(runs["kinds"][1], "the --dataset sources and held-out files hold different kinds of rows",
                          "chats: instruction data", "pairs: preference pairs")
