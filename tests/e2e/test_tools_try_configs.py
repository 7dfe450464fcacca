"""app.tools.try_configs: borrowed DeepSpeed files tried as a new user would, each counted."""
import json


from app.tools import try_configs
from conftest import REPO


def test_a_folder_of_configs_is_tried_and_counted(tmp_path, capsys):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "auto.json").write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": "auto",
                                                  "train_micro_batch_size_per_gpu": "auto"}))
    (folder / "typo.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "steps_per_prnt": 10}))
    (folder / "notes.txt").write_text("not a config")
    for name in ("trl-deepspeed_zero2.yaml", "trl-fsdp2.yaml"):  # accelerate config files, as TRL ships them
        (folder / name).write_text((REPO / "tests" / "data" / "accelerate" / name).read_text())
    assert try_configs.main([str(folder), "--steps", "2", "--output_dir", str(tmp_path / "runs")]) == 0
    rows = json.loads((tmp_path / "runs" / "report.json").read_text())
    assert [(row["file"].rsplit("/", 1)[-1], row["kind"]) for row in rows] == [
        ("auto.json", "trained"), ("trl-deepspeed_zero2.yaml", "trained"), ("trl-fsdp2.yaml", "one line"),
        ("typo.json", "one line")]
    assert "is not an accelerate config for DeepSpeed (distributed_type FSDP)" in rows[2]["line"]
    assert "did you mean 'steps_per_print'" in rows[3]["line"]
    assert capsys.readouterr().out.splitlines()[-1] == "4 file(s): 2 trained, 2 one line"
