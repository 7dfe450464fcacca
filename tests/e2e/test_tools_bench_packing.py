"""The packed-against-padded benchmark: both runs on the same data, their measured rates and ratio reported."""
import json
import sys

from conftest import run


def test_packed_and_padded_rates_on_the_worked_example(tmp_path):
    from app.tools.instructions import write, write_model
    chats, model = write(tmp_path, 400, seed=1), write_model(tmp_path, seed=1)
    out = tmp_path / "bench"
    result = run([sys.executable, "-m", "app.tools.bench_packing", "--model", model, "--dataset", chats, "--steps", "4",
                  "--output_dir", out, "--", "--deepspeed_config", "ds_configs/zero2.json"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    padded, packed = report["padded"], report["packed"]
    assert padded["steps"] == packed["steps"] == 3, "the first step of each run is not timed"
    assert padded["rows_per_s"] == padded["samples_per_s"] > 0, "a padded sample is one row"
    assert packed["rows_per_s"] > 2 * packed["samples_per_s"], "a packed block holds several rows"
    assert report["packed_over_padded"] == packed["real_tokens_per_s"] / padded["real_tokens_per_s"]
    assert "packed / padded: " in result.stdout
    assert json.loads((out / "packed" / "summary.json").read_text())["zero_stage"] == 2, "the flags after -- reach it"
