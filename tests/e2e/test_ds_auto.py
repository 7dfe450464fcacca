"""DeepSpeed configs as the ecosystem writes them, trained for real: each shape (tests/unit/test_ds_auto.py) runs
a few steps on this CPU, a GPU config included, and the "auto" file resumes exactly, its filled-in values said
once and saved; TRL's accelerate config file trains as the JSON accelerate builds from it."""
import json
from pathlib import Path

from app.ds import auto as ds_auto
from conftest import read_metrics, read_summary, train_jobs
from unit.test_accelerate_file import TRL_ZERO3
from unit.test_ds_auto import CLUSTER_FP16, HF_ZERO2, HF_ZERO3, NO_OPTIMIZER, _write

ZERO3_OFFLOAD_PARAMS_ONLY = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {
    "stage": 3, "offload_param": {"device": "cpu", "pin_memory": True}}}


def test_configs_people_bring_train_on_a_cpu_and_resume_exactly(tmp_path):
    """Each shape trains 3 steps on this CPU (one launch); the "auto" file resumed from step 2 gives the losses of
    the unbroken run, its filled-in values said once and saved."""
    files = {name: _write(tmp_path, name, ds) for name, ds in (
        ("hf_zero2", HF_ZERO2), ("hf_zero3", HF_ZERO3), ("no_optimizer", NO_OPTIMIZER),
        ("zero3_offload_params", ZERO3_OFFLOAD_PARAMS_ONLY), ("cluster_fp16", CLUSTER_FP16))}
    run = ["--max_steps", "3", "--log_interval", "1", "--eval_interval", "3", "--save_interval", "2"]
    cases = [["--deepspeed_config", path, *run, "--output_dir", tmp_path / name] for name, path in files.items()]
    resumed = tmp_path / "resumed"
    cases.append(["--deepspeed_config", files["hf_zero2"], *run, "--output_dir", resumed, "--resume",
                  tmp_path / "hf_zero2" / "checkpoints" / "step00000002"])
    cases += [["--deepspeed_config", file, *run, "--output_dir", tmp_path / name]
              for name, file in _accelerate(tmp_path)]
    outputs = train_jobs("ranks", 1, cases)
    assert "fp32 (" in outputs[4] and "sets fp16.enabled true, which needs a CUDA device" in outputs[4]
    assert outputs[0].count("filled in (saved in deepspeed_auto.json):") == 1
    for name in files:
        rows = read_metrics(tmp_path / name)[0]
        assert len(rows) == 3 and read_summary(tmp_path / name)["steps"] == 3, name
    saved = json.loads((tmp_path / "hf_zero2" / ds_auto.FILE).read_text())
    assert saved["optimizer.params.lr"] == {"value": 2e-3, "from": ds_auto.FILLED["optimizer.params.lr"]}
    assert saved["train_batch_size"]["value"] == 32
    whole = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "hf_zero2")[0]}
    assert {r["step"]: r["loss"] for r in read_metrics(resumed)[0]} == {3: whole[3]}
    losses = [[r["loss"] for r in read_metrics(tmp_path / name)[0]] for name in ("trl_zero3", "trl_zero3_json")]
    assert len(losses[0]) == 3 and losses[0] == losses[1], "TRL's accelerate file trains as the JSON accelerate builds"


def _accelerate(tmp_path) -> list:
    """(name, file) of TRL's published accelerate config for ZeRO-3 and of the JSON accelerate builds from it."""
    yaml = Path(__file__).resolve().parents[1] / "data" / "accelerate" / "trl-deepspeed_zero3.yaml"
    return [("trl_zero3", yaml), ("trl_zero3_json", _write(tmp_path, "trl_zero3_json", TRL_ZERO3))]
