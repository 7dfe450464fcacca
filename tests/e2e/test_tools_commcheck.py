"""The communication check, launched like training (as a module), verifies every primitive and reports bandwidth."""
import pytest

from conftest import BIN, free_port, run


@pytest.mark.parametrize("world", [2, 3])
def test_commcheck_through_the_deepspeed_launcher(world):
    result = run([str(BIN / "deepspeed"), "--num_gpus", str(world), "--master_port", str(free_port()),
                  "--module", "app.tools.commcheck", "--sizes", "8,65536", "--iters", "3"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert out.count(f"verified on {world} rank(s)") == 1, "rank 0 alone reports"
    for name in ("send/recv", "isend/irecv", "broadcast", "all_reduce sum/max/min/product", "reduce",
                 "all_gather", "gather", "scatter", "new_group subgroup"):
        assert name in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["all_reduce"], ["all_gather"],
                                                                               ["broadcast"])]
    assert len(rows) == 3 * 2, out
    assert all(float(r[2]) > 0 for r in rows), rows
    assert all(float(r[4]) > 0 for r in rows if r[1] == "65536"), "64 KiB moves at a measurable rate"


def test_commcheck_through_torchrun():
    result = run([str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()),
                  "-m", "app.tools.commcheck", "--sizes", "8", "--iters", "2"], timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("verified on 2 rank(s)") == 1 and "started by torchrun" in result.stdout


def test_commcheck_without_a_launcher_is_one_rank():
    result = run([str(BIN / "python"), "-m", "app.tools.commcheck", "--sizes", "8", "--iters", "2"], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "verified on 1 rank(s)" in result.stdout and "send/recv" not in result.stdout
