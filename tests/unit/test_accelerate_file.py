"""An accelerate config file passed as --deepspeed_config: read as the DeepSpeed JSON accelerate builds from it,
TRL's published files as they are; what it cannot mean here is one line."""
import json
from pathlib import Path

import pytest

from app.ds import accelerate_file
from app.ds.config import load_ds_config
from app.errors import UserError

DATA = Path(__file__).resolve().parents[1] / "data" / "accelerate"
DS = "distributed_type: DEEPSPEED\n"


def _read(path) -> tuple:
    said = []
    return accelerate_file.ds_config(Path(path), said.append), said


TRL_ZERO3 = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1,
             "gradient_clipping": "auto",
             "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "none", "nvme_path": None},
                                   "offload_param": {"device": "none", "nvme_path": None},
                                   "stage3_gather_16bit_weights_on_model_save": True},
             "bf16": {"enabled": True}, "fp16": {"enabled": False}}
"""The DeepSpeed JSON accelerate builds from TRL's deepspeed_zero3.yaml."""


def test_trls_zero3_file_is_the_json_accelerate_builds_and_its_launch_settings_are_said():
    ds, said = _read(DATA / "trl-deepspeed_zero3.yaml")
    assert ds == TRL_ZERO3
    assert len(said) == 1 and said[0].startswith(f"note: {DATA / 'trl-deepspeed_zero3.yaml'} is an accelerate config")
    assert "(num_machines: 1, num_processes: 8, deepspeed_multinode_launcher: standard) are the launcher's" in said[0]
    assert "not read here" not in said[0], "zero3_init_flag true at stage 3 is what the app does"


def test_accelerates_variables_do_not_change_what_the_file_says(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    assert _read(DATA / "trl-deepspeed_zero3.yaml")[0] == TRL_ZERO3


def test_the_loaded_file_passes_the_checks_of_any_deepspeed_json():
    ds = load_ds_config(DATA / "trl-deepspeed_zero2.yaml", cuda=True, bf16_ok=True, say=lambda line: None)
    assert ds["zero_optimization"]["stage"] == 2 and ds["bf16"] == {"enabled": True}
    assert ds["gradient_accumulation_steps"] == "auto", "accelerate leaves it to the run: so does the app"


def test_trls_ulysses_file_splits_sequences_and_says_what_is_not_read_here():
    ds, said = _read(DATA / "trl-alst_ulysses_4gpu.yaml")
    assert ds["sequence_parallel_size"] == 2 and ds["zero_optimization"]["stage"] == 3
    assert said[0].endswith("; not read here: seq_parallel_communication_data_type, zero3_init_flag, "
                            "parallelism_config_dp_shard_size, parallelism_config_sp_seq_length_is_variable, "
                            "parallelism_config_sp_attn_implementation"), said[0]


def test_a_deepspeed_config_file_it_names_is_read_beside_it_as_accelerate_reads_it(tmp_path):
    (tmp_path / "zero2.json").write_text(json.dumps({
        "zero_optimization": {"stage": 2}, "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": 4}))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: zero2.json\n  zero3_init_flag: false\n")
    ds, said = _read(tmp_path / "acc.yaml")
    assert ds == {"zero_optimization": {"stage": 2}, "gradient_clipping": "auto", "train_micro_batch_size_per_gpu": 4,
                  "gradient_accumulation_steps": 1, "bf16": {"enabled": False}, "fp16": {"enabled": False}}, \
        "accelerate's own: an accumulation of 1 where the file has none; no mixed_precision is 'no', which turns " \
        "the file's bf16 'auto' off"


def test_the_note_of_what_the_file_became_shows_no_secret(tmp_path):
    """A monitor's key in the JSON it names is the run's (the engine gets it), never the note's."""
    (tmp_path / "z.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
                                                 "comet": {"enabled": True, "api_key": "COMET-SECRET-123"}}))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: z.json\n")
    ds, said = _read(tmp_path / "acc.yaml")
    assert ds["comet"]["api_key"] == "COMET-SECRET-123"
    assert said and not any("COMET-SECRET-123" in line for line in said) and "<redacted>" in said[0]



@pytest.mark.parametrize("lines, precision", [("fp16: true\n", "fp16"), ("fp16: false\n", "no"),
                                              ("fp16: true\nmixed_precision: bf16\n", "bf16"), ("", "no")])
def test_the_older_fp16_key_is_read_as_accelerate_reads_it(tmp_path, lines, precision):
    from accelerate.commands.config.config_args import ClusterConfig
    path = tmp_path / "old.yaml"
    path.write_text(DS + lines + "deepspeed_config:\n  zero_stage: 2\n")
    assert str(ClusterConfig.from_yaml_file(path).mixed_precision or "no").split(".")[-1].lower() == precision
    ds, said = _read(path)
    assert (ds["fp16"]["enabled"], ds["bf16"]["enabled"]) == (precision == "fp16", precision == "bf16")
    assert "not read here" not in said[0]


@pytest.mark.parametrize("lines, said", [("dynamo_config:\n  dynamo_backend: INDUCTOR\n", "INDUCTOR"),
                                         ("dynamo_backend: inductor\n", "INDUCTOR"),
                                         ("dynamo_config: {}\n", None), ("dynamo_backend: 'NO'\n", None),
                                         ("dynamo_backend: 'NO'\ndynamo_config:\n  dynamo_backend: INDUCTOR\n", None),
                                         ("dynamo_backend: eager\ndynamo_config: {}\n", "EAGER")])
def test_a_compile_backend_it_asks_for_is_said_to_be_the_apps_compile_flag(tmp_path, lines, said):
    path = tmp_path / "dynamo.yaml"
    path.write_text(DS + lines + "mixed_precision: bf16\ndeepspeed_config:\n  zero_stage: 3\n")
    note = _read(path)[1][0]
    assert (f"; its dynamo_backend {said} is --compile's here (auto: on a GPU, off on a CPU)" in note) == bool(said)
    assert ("dynamo_backend" in note) == bool(said), note
    from accelerate.commands.config.config_args import ClusterConfig
    asked = (ClusterConfig.from_yaml_file(path).dynamo_config or {}).get("dynamo_backend")
    assert (str(asked).upper() if asked else None) == said, "as accelerate reads the file"


def test_what_accelerate_refuses_is_one_line_in_its_words(tmp_path):
    (tmp_path / "bf16.json").write_text(json.dumps({"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: bf16.json\n  zero_stage: 3\n")
    with pytest.raises(UserError, match=r"acc.yaml: accelerate refuses zero_stage beside a deepspeed_config_file; "
                                        r"set it in .*bf16.json instead"):
        _read(tmp_path / "acc.yaml")
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\nfp16: true\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: bf16.json\n")
    with pytest.raises(UserError, match=r"acc.yaml: accelerate refuses fp16 beside a deepspeed_config_file"):
        _read(tmp_path / "acc.yaml")  # the older key is mixed_precision fp16 to accelerate
    (tmp_path / "bf16.json").write_text(json.dumps({"bf16": {"enabled": True}}))
    (tmp_path / "acc.yaml").write_text("distributed_type: DEEPSPEED\ndeepspeed_config:\n"
                                       "  deepspeed_config_file: bf16.json\n")
    with pytest.raises(UserError, match=r"acc.yaml: accelerate refuses its DeepSpeed settings: Please specify the "
                                        r"ZeRO optimization config in the DeepSpeed config.$"):
        _read(tmp_path / "acc.yaml")


@pytest.mark.parametrize("text, fragment", [
    (None, "is not an accelerate config for DeepSpeed (distributed_type FSDP): pass a DeepSpeed JSON file"),
    ("distributed_type: MULTI_GPU\nnum_processes: 2\n", "(distributed_type MULTI_GPU)"),
    ("distributed_type: DEEPSPEED\nmixed_precision: bf16\n", "(no deepspeed_config section)"),
    ("deepspeed_config:\n  zero_stage: 3\n", "is not an accelerate config for DeepSpeed (distributed_type NONE)"),
    (DS + "deepspeed_config:\n  zero_stge: 3\n", "deepspeed_config has 'zero_stge'; did you mean 'zero_stage'?"),
    (DS + "mixed_precision: fp8\ndeepspeed_config:\n  zero_stage: 2\n", "mixed_precision fp8 is not one this app"),
    (DS + "deepspeed_config:\n  deepspeed_config_file: nowhere.json\n", "its deepspeed_config_file nowhere.json "
                                                                         "is not found"),
    (DS + "deepspeed_config:\n  zero_stage: 3\nparallelism_config:\n  parallelism_config_tp_size: 2\n",
     "parallelism_config_tp_size 2: tensor parallelism comes from the DeepSpeed JSON"),
    (DS + "deepspeed_config:\n  zero_stage: 3\nparallelism_config:\n  parallelism_config_sp_size: 2\n"
     "  parallelism_config_sp_backend: fsdp\n", "sequence parallelism here is DeepSpeed's Ulysses"),
    (DS + "deepspeed_config:\n  zero_stage: 3\nparallelism_config:\n  parallelism_config_sp_size: two\n",
     "parallelism_config_sp_size 'two' is not a size: write a whole number of at least 1, such as 2"),
    (DS + "deepspeed_config:\n  zero_stage: 3\nparallelism_config:\n  parallelism_config_sp_size: 0\n",
     "parallelism_config_sp_size 0 is not a size"),
    (DS + "deepspeed_config:\n  zero_stage: 3\nparallelism_config:\n  parallelism_config_sp_size: -2\n",
     "parallelism_config_sp_size -2 is not a size"),
    (DS + "deepspeed_config:\n  zero_stage: 3\nparallelism_config: 2\n",
     "parallelism_config 2 is not a mapping: write its sizes under it"),
    (DS + "deepspeed_config:\n  zero_stage: 3\nparallelism_config: []\n", "parallelism_config [] is not a mapping"),
    (DS + "deepspeed_config:\n  zero_stage: 3\nparallelism_config:\n  parallelism_config_tp_size: 1.5\n",
     "parallelism_config_tp_size 1.5 is not a size"),
    ("deepspeed_config: [zero_stage: 3\n", "is not valid YAML"),
    ("- zero_stage: 3\n", "must hold a YAML mapping at the top level"),
])
def test_what_it_cannot_mean_here_is_one_line(tmp_path, text, fragment):
    path = DATA / "trl-fsdp2.yaml" if text is None else tmp_path / "acc.yml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UserError) as caught:
        load_ds_config(path, cuda=False, say=lambda line: None)
    assert fragment in str(caught.value) and "\n" not in str(caught.value), caught.value
    assert str(caught.value).startswith(str(path))


def test_only_yaml_files_are_read_as_accelerate_configs():
    assert accelerate_file.is_accelerate_file(Path("a/b.yaml")) and accelerate_file.is_accelerate_file("c.YML")
    assert not accelerate_file.is_accelerate_file(Path("ds_configs/zero3.json"))
