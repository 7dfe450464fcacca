"""app.tools.try_configs: borrowed DeepSpeed files tried as a new user would, each counted."""
import json


from app.tools import try_configs


def test_a_folder_of_configs_is_tried_and_counted(tmp_path, capsys):
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "auto.json").write_text(json.dumps({"zero_optimization": {"stage": 1}, "gradient_clipping": "auto",
                                                  "train_micro_batch_size_per_gpu": "auto"}))
    (folder / "typo.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 4, "steps_per_prnt": 10}))
    (folder / "notes.txt").write_text("not a config")
    assert try_configs.main([str(folder), "--steps", "2", "--output_dir", str(tmp_path / "runs")]) == 0
    rows = json.loads((tmp_path / "runs" / "report.json").read_text())
    assert [(row["file"].rsplit("/", 1)[-1], row["kind"]) for row in rows] == [("auto.json", "trained"),
                                                                              ("typo.json", "one line")]
    assert "did you mean 'steps_per_print'" in rows[1]["line"]
    assert capsys.readouterr().out.splitlines()[-1] == "2 file(s): 1 trained, 1 one line"
