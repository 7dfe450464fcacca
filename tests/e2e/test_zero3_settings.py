"""ZeRO-3 as ds_configs/zero3.json sets it, with DeepSpeed's own settings (each transformer block a leaf module
gathered whole by one hook, a prefetch bucket of one block, on CPU ranks no persistent weight), changes how
parameters are gathered and gradients reduced, never what a step computes: 2 ranks train the losses stock ZeRO-3
trains, step by step, eager and compiled."""
import json

import pytest

from conftest import REPO, read_metrics, train_jobs, write_text_rows

STOCK_KEYS = ("stage", "overlap_comm", "contiguous_gradients")  # zero3.json's section less DeepSpeed's settings


def stock_zero3(tmp_path):
    """ds_configs/zero3.json with DeepSpeed's defaults for every ZeRO-3 setting: a hook on every submodule."""
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds["zero_optimization"] = {k: v for k, v in ds["zero_optimization"].items() if k in STOCK_KEYS}
    path = tmp_path / "zero3-stock.json"
    path.write_text(json.dumps(ds))
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (losses, output) of 8 steps of gpt2-tiny on 2 ranks under stock and shipped ZeRO-3, eager and
    compiled, in one launch; "folder": where they ran."""
    tmp = tmp_path_factory.mktemp("zero3")
    corpus = write_text_rows(tmp / "corpus.txt", 400)
    configs = {"stock": stock_zero3(tmp), "shipped": REPO / "ds_configs" / "zero3.json"}
    jobs = {f"{name}-{mode}": ["--model", "gpt2-tiny", "--dataset", corpus, "--block_size", 64, "--deepspeed_config",
                               config, "--max_steps", 8, "--log_interval", 1, "--eval_interval", 8, "--compile", mode,
                               "--output_dir", tmp / f"{name}-{mode}"]
            for mode in ("off", "on") for name, config in configs.items()}
    outputs = train_jobs("ranks", 2, list(jobs.values()), wrapper=("tests/helpers/engines_alive.py",))
    return {"folder": tmp, **{name: ([row["loss"] for row in read_metrics(tmp / name)[0]], output)
                              for name, output in zip(jobs, outputs)}}


@pytest.mark.parametrize("mode", ["off", "on"])
def test_the_shipped_zero3_settings_train_the_losses_of_stock_zero3(runs, mode):
    stock, (shipped, output) = runs[f"stock-{mode}"][0], runs[f"shipped-{mode}"]
    assert 'zero_optimization.leaf_module.classes = ["GPT2Block"]' in output, output[-3000:]
    assert "zero_optimization.stage3_prefetch_bucket_size = 789760" in output  # one GPT2Block's parameters
    assert "zero_optimization.stage3_param_persistence_threshold = 0" in output  # CPU ranks: nothing persists
    assert ("compile: compiling" in output) == (mode == "on")
    assert len(stock) == len(shipped) == 8 and shipped[-1] < shipped[0]
    assert max(abs(a - b) for a, b in zip(stock, shipped)) < 1e-6, list(zip(stock, shipped))


def test_each_job_of_a_pool_starts_without_the_engines_of_the_jobs_before(runs):
    """tests/helpers/jobs.py runs these jobs in one process as if each had its own: ZeRO-3's parameter coordinator
    keeps every engine it served after its first step (an lru_cache on its class), so a job after a ZeRO-3 job would
    hold that engine and its states (on the H200, a llama-1b engine's 27 GB in the next run's peak) unless the pool
    lets go of it between jobs (forget_engines), as the benchmark does between its modes."""
    from helpers.engines_alive import SAID
    for name in ("stock-off", "shipped-off", "stock-on", "shipped-on"):
        said = [line for line in runs[name][1].splitlines() if line.startswith(SAID)]
        assert said and all(line == f"{SAID}0" for line in said), (name, said)


def test_zero3s_reduce_bucket_holds_the_whole_model_where_the_json_sets_none(runs):
    """The app caps an unset reduce_bucket_size at the trainable parameters (DeepSpeed allocates whole buckets):
    counted whole, not as the empty tensors zero.Init leaves in a partitioned model, which made a bucket of one
    element and a reduce-scatter per parameter. gpt2-tiny: 8,192 x 256 token and 128 x 256 position embeddings,
    4 blocks of 789,760 and the last norm's 512."""
    state = json.loads(next((runs["folder"] / "shipped-off" / "checkpoints").glob("step*/trainer_state.json"))
                       .read_text())
    assert state["deepspeed_config"]["zero_optimization"]["reduce_bucket_size"] == \
        8192 * 256 + 128 * 256 + 4 * 789_760 + 512
