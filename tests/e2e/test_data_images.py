"""The synthetic smoke data trained for real: the default CNN learns it, and a run whose optimizer step changes
nothing stays at chance. The image datasets themselves: tests/unit/test_data_images.py."""

from conftest import config_variant, read_summary, train_jobs


def test_synthetic_images_are_learnt_and_tell_a_run_that_does_not_learn(tmp_path):
    """The smoke data: the default CNN passes 90% held out within 100 steps; with a learning rate of 0 (an
    optimizer step that changes nothing) it stays at chance."""
    frozen = config_variant(tmp_path, "dp", optimizer={"type": "AdamW", "params": {"torch_adam": True, "lr": 0.0}})
    args = ["--dataset", "synthetic", "--max_steps", 100, "--log_interval", 100, "--eval_interval", 100]
    train_jobs("python", 1, [[*args, "--output_dir", tmp_path / "learns"],
                             [*args, "--deepspeed_config", frozen, "--output_dir", tmp_path / "frozen"]])
    assert read_summary(tmp_path / "learns")["eval_accuracy"] > 0.9
    assert read_summary(tmp_path / "frozen")["eval_accuracy"] < 0.2
