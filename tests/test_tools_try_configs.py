"""app.tools.try_configs: borrowed DeepSpeed files tried as a new user would, each counted."""
import json

import pytest

from app.tools import try_configs


def test_each_outcome_is_counted_by_what_the_user_saw():
    assert try_configs.outcome("done: eval_loss 0.3\n", 0) == ("trained", "")
    assert try_configs.outcome("mode: ...\nerror: x.json: unknown DeepSpeed key 'a'\n", 2) == \
        ("one line", "error: x.json: unknown DeepSpeed key 'a'")
    assert try_configs.outcome("Traceback (most recent call last):\n  ...\nKeyError: 'b'\n", 1) == \
        ("traceback", "KeyError: 'b'")


@pytest.mark.slow
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
