"""The app's own Settings and command line: impossible values refused, flags parsed with the default config."""
import pytest

from app import settings as config
from app.errors import UserError


@pytest.mark.parametrize("field, value", [("epochs", 0), ("log_interval", 0), ("max_steps", -1), ("num_workers", -2)])
def test_settings_reject_impossible_values(field, value):
    with pytest.raises(UserError, match=f"--{field}"):
        config.Settings(**{field: value})


def test_parse_reads_flags_and_the_default_config():
    settings, ds = config.parse(["--model", "mlp", "--max_steps", "7", "--local_rank=1"])
    assert settings.model == "mlp" and settings.max_steps == 7
    assert settings.deepspeed_config.endswith("ds_configs/dp.json") and ds["zero_optimization"]["stage"] == 0


@pytest.mark.parametrize("flag, value", [("compile", "always"), ("tf32", "auto")])
def test_compile_and_tf32_flags_are_checked(flag, value):
    with pytest.raises(UserError, match=f"--{flag} must be one of"):
        config.parse([f"--{flag}", value])
