"""The quarantine of DeepSpeed's internals (app/ds/internals/__init__.py): what it exports, the DeepSpeed it is for."""
import re

import deepspeed

from app.ds import internals as ds_internals
from conftest import REPO


def test_every_internal_the_app_calls_is_exported_by_the_package():
    """A name missing from the package fails only when the path that calls it runs (a pipeline, a resume)."""
    used = {name for path in (REPO / "app").rglob("*.py")
            for name in re.findall(r"\bds_internals\.(\w+)", path.read_text())}
    assert used, "no use of ds_internals found"
    assert sorted(used - set(ds_internals.__all__)) == []
    assert [name for name in ds_internals.__all__ if not hasattr(ds_internals, name)] == []


def test_the_package_is_written_for_the_deepspeed_that_requirements_txt_pins():
    pinned = re.search(r"^deepspeed==(\S+)$", (REPO / "requirements.txt").read_text(), re.M).group(1)
    assert ds_internals.WRITTEN_FOR == pinned


def test_the_version_note_is_silent_on_that_version_and_names_both_versions_on_another():
    note = ds_internals.version_note()
    if deepspeed.__version__ == ds_internals.WRITTEN_FOR:
        assert note == ""
    else:
        assert note.startswith(f"warning: DeepSpeed {deepspeed.__version__} is installed")
        assert f"install deepspeed=={ds_internals.WRITTEN_FOR}" in note and "\n" not in note
