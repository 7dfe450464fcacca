"""app.tools.try_configs: each outcome counted by what the user saw (trained, one line, a traceback)."""
import pytest

from app.tools import try_configs


def test_each_outcome_is_counted_by_what_the_user_saw():
    assert try_configs.outcome("done: eval_loss 0.3\n", 0) == ("trained", "")
    assert try_configs.outcome("mode: ...\nerror: x.json: unknown DeepSpeed key 'a'\n", 2) == \
        ("one line", "error: x.json: unknown DeepSpeed key 'a'")
    assert try_configs.outcome("Traceback (most recent call last):\n  ...\nKeyError: 'b'\n", 1) == \
        ("traceback", "KeyError: 'b'")


def test_a_folder_gives_its_deepspeed_and_accelerate_files_in_order(tmp_path):
    for name in ("b.json", "a.conf", "c.yaml", "d.YML", "notes.md", "e.py"):
        (tmp_path / name).write_text("{}")
    assert [p.name for p in try_configs.files_of([tmp_path])] == ["a.conf", "b.json", "c.yaml", "d.YML"]
    assert try_configs.files_of([tmp_path / "notes.md"]) == [tmp_path / "notes.md"], "a file named is tried as named"


def test_steps_below_one_are_one_line_before_any_run(tmp_path, capsys):
    """--steps 0 would reach train.py as --max_steps 0, its epochs' default: whole runs for a try."""
    for steps in ("0", "-1"):
        with pytest.raises(SystemExit) as caught:
            try_configs.main([str(tmp_path / "a.json"), "--steps", steps, "--output_dir", str(tmp_path / "out")])
        assert caught.value.code == 2 and "--steps must be at least 1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
