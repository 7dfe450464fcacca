"""The app's own Settings and command line: impossible values refused, flags parsed with the default config."""
import pytest

from app import settings as config
from app.errors import UserError
from conftest import REPO


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


def test_the_readmes_flags_table_names_every_flag_and_no_other():
    """The README's table of flags against the command line (Settings): a flag added, renamed or dropped in one
    shows here until the other follows."""
    import re
    from dataclasses import fields
    from app.settings import Settings
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| flag | default | meaning |"):].split("\n\n")[0]
    named = {name for row in table.splitlines()[2:] for name in re.findall(r"`--(\w+)`", row.split(" | ")[0])}
    assert named == {f.name for f in fields(Settings)}, (named ^ {f.name for f in fields(Settings)})
    for row in table.splitlines()[2:]:
        flag = re.findall(r"`--(\w+)`", row)[0]
        default = Settings.__dataclass_fields__[flag].default
        if isinstance(default, int) and not isinstance(default, bool):
            assert str(default) in row.split(" | ")[1], f"--{flag}: the README gives another default than {default}"
