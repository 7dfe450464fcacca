"""The DeepSpeed dict of a run (app/ds/run_dict.py): planned before the data, made final once; the engine gets
exactly the final dict."""
import torch

from app.ds import auto as ds_auto
from app.ds import run_dict

JSON = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 5, "total_num_steps": "auto"}},
        "zero_optimization": {"stage": 2}, "torch_autocast": {"enabled": "auto", "dtype": "bfloat16"}}


def test_the_planned_dict_settles_precision_auto_and_batch_sizes_on_this_device():
    ds, filled, note = run_dict.planned(dict(JSON), "j.json", torch.device("cpu"), 2, ds_auto.Facts())
    assert ds["torch_autocast"]["enabled"] is False and "no CUDA device" in note
    assert ds["train_batch_size"] == 4 * 2 * 2
    assert ds["scheduler"]["params"]["total_num_steps"] == "auto", "the run's length is not known yet"



def test_deepspeeds_deepcompile_is_turned_off_on_cpu_ranks_and_said_kept_on_a_gpu():
    asked = {**JSON, "compile": {"deepcompile": True, "free_activation": True}}
    ds, filled, _ = run_dict.planned(dict(asked), "j.json", torch.device("cpu"), 2, ds_auto.Facts(cpu=True))
    assert ds["compile"] == {"deepcompile": False, "free_activation": True}
    assert filled["compile.deepcompile"] == run_dict.DEEPCOMPILE_OFF
    assert "compile.deepcompile = false  (DeepSpeed's DeepCompile runs on CUDA devices only" in \
        ds_auto.say(ds, filled, None, main=False)
    bench, filled = run_dict.for_benchmark(dict(asked), 4, ds_auto.Facts(cpu=True), 1, 3, "j.json")
    assert bench["compile"]["deepcompile"] is False and filled["compile.deepcompile"] == run_dict.DEEPCOMPILE_OFF
    for written in ("true", 1, "on"):  # pydantic's bool, as DeepSpeed reads the file
        read = {**JSON, "compile": {"deepcompile": written}}
        ds, _, _ = run_dict.planned(read, "j.json", torch.device("cpu"), 2, ds_auto.Facts(cpu=True))
        assert ds["compile"]["deepcompile"] is False, written
    for kept in ("false", 0, "maybe"):  # off, or left for DeepSpeed's own check to refuse
        read = {**JSON, "compile": {"deepcompile": kept}}
        ds, _, _ = run_dict.planned(read, "j.json", torch.device("cpu"), 2, ds_auto.Facts(cpu=True))
        assert ds["compile"]["deepcompile"] == kept, kept
    gpu, filled, _ = run_dict.planned(dict(asked), "j.json", torch.device("cpu"), 2, ds_auto.Facts(cpu=False))
    assert gpu["compile"] == asked["compile"] and "compile.deepcompile" not in filled
    plain, filled, _ = run_dict.planned(dict(JSON), "j.json", torch.device("cpu"), 2, ds_auto.Facts(cpu=True))
    assert "compile" not in plain and "compile.deepcompile" not in filled


def test_the_final_dict_has_the_runs_lengths_its_resume_and_what_the_engine_needs():
    ds, filled, _ = run_dict.planned(dict(JSON), "j.json", torch.device("cpu"), 2, ds_auto.Facts())
    final = run_dict.final(ds, filled, 40, universal=True, trainable=1000, tensor=1)
    assert final["scheduler"]["params"]["total_num_steps"] == 40
    assert final["checkpoint"]["load_universal"] is True
    assert final["timers"] == run_dict.TIMERS_OFF and final["zero_optimization"]["reduce_bucket_size"] == 1000
    assert run_dict.final(ds, filled, 40, universal=False, trainable=1000, tensor=1) == \
        {k: v for k, v in final.items() if k != "checkpoint"}, "a fresh run loads no universal checkpoint"


def test_what_the_json_sets_stays_and_autotp_derives_the_global_batch():
    ds = {**JSON, "timers": {"throughput": {"enabled": True}},
          "zero_optimization": {"stage": 2, "reduce_bucket_size": 5}, "train_batch_size": 16}
    engine = run_dict.for_engine(ds, trainable=1000, tensor=1)
    assert engine["timers"] == {"throughput": {"enabled": True}}
    assert engine["zero_optimization"]["reduce_bucket_size"] == 5
    assert "train_batch_size" not in run_dict.for_engine(ds, trainable=1000, tensor=2)
    assert run_dict.for_engine(engine, 1000, 1) == engine, "made whole once: making it again changes nothing"


def test_trainable_counts_the_parameters_that_train():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    model[0].requires_grad_(False)
    assert run_dict.trainable(model) == 3 + 1


def test_the_reference_dict_keeps_precision_and_zero3_partitioning_and_drops_the_optimizer():
    ds = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "bf16": {"enabled": True},
          "fp16": {"enabled": False}, "optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"},
          "gradient_clipping": 1.0}
    three = {"stage": 3, "offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"},
             "stage3_prefetch_bucket_size": 100}
    ref = run_dict.for_reference({**ds, "zero_optimization": three}, 4)
    assert "optimizer" not in ref and "scheduler" not in ref
    assert ref["bf16"] == {"enabled": True} and ref["fp16"] == {"enabled": False}
    assert ref["zero_optimization"] == {"stage": 3, "offload_param": {"device": "cpu"},
                                        "stage3_prefetch_bucket_size": 100}
    assert "offload_optimizer" in three and ds["train_micro_batch_size_per_gpu"] == 8, "the policy's dict is kept"
    assert (ref["train_micro_batch_size_per_gpu"], ref["gradient_accumulation_steps"], ref["train_batch_size"]) == \
        (1, 1, 4), "it never steps: one sample per replica"
    for stage in (1, 2):
        zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
        assert run_dict.for_reference({**ds, "zero_optimization": zero}, 2)["zero_optimization"] == {"stage": 0}
    assert run_dict.for_reference(ds, 1)["zero_optimization"] == {"stage": 0}


def test_a_trial_engine_takes_one_step_of_the_micro_batch_tried():
    ds, _, _ = run_dict.planned(dict(JSON), "j.json", torch.device("cpu"), 2, ds_auto.Facts())
    trial = run_dict.for_trial(ds, 3, 2)
    assert (trial["train_micro_batch_size_per_gpu"], trial["gradient_accumulation_steps"],
            trial["train_batch_size"]) == (3, 1, 6)
    assert trial["scheduler"]["params"]["total_num_steps"] == 1, "\"auto\" waits for the run: one step stands in"
    assert ds["train_micro_batch_size_per_gpu"] == 4, "the planned dict is kept"


def test_the_benchmarks_engine_fills_auto_as_a_run_and_schedules_the_benchmarks_steps():
    given = {**JSON, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}
    facts = ds_auto.Facts(hidden=64, blocks=("LlamaDecoderLayer",), block_size=1000)
    ds, _ = run_dict.for_benchmark(given, 8, facts, 2, 30, "j.json")
    assert (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"]) == \
        (8, 1, 16)
    assert ds["scheduler"]["params"]["total_num_steps"] == 30
    assert ds["zero_optimization"]["stage3_prefetch_bucket_size"] != "auto"
