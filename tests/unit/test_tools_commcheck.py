"""The communication check's parts on a one-rank gloo group in this process: bus factors, checks, table rows, flags."""
import pytest
import torch
import torch.distributed as torch_dist

from app.tools import commcheck

CPU = torch.device("cpu")


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of this process alone, left at the end of the test."""
    torch_dist.init_process_group("gloo", store=torch_dist.FileStore(str(tmp_path / "store"), 1), rank=0,
                                  world_size=1)
    yield
    torch_dist.destroy_process_group()


@pytest.mark.parametrize("world, all_reduce, all_gather", [(1, 0.0, 0.0), (2, 1.0, 0.5), (4, 1.5, 0.75),
                                                           (8, 1.75, 0.875)])
def test_bus_bandwidth_counts_the_bytes_each_link_carries_as_the_nccl_tests_do(world, all_reduce, all_gather):
    factors = {op: factor(world) for op, factor in commcheck.BUS_FACTOR.items()}
    assert factors == {"all_reduce": all_reduce, "all_gather": all_gather, "broadcast": 1.0}


def test_a_wrong_answer_names_the_collective_the_rank_and_both_values(one_rank):
    commcheck._check("all_reduce", torch.full((4,), 3.0), 3)
    commcheck._check("gather", torch.tensor([5, 5]), 5)
    with pytest.raises(AssertionError) as caught:
        commcheck._check("all_reduce ReduceOp.SUM", torch.tensor([3.0, 3.0, 2.0]), 3)
    assert str(caught.value) == "all_reduce ReduceOp.SUM: rank 0 got [3.0, 3.0, 2.0], expected 3"


def test_one_rank_verifies_every_collective_and_no_point_to_point(one_rank):
    assert commcheck.verify_primitives(CPU) == [
        "rank and world size", "barrier", "broadcast", "all_reduce sum/max/min/product", "reduce", "all_gather",
        "gather", "scatter", "new_group subgroup"]


def test_the_table_has_a_row_per_collective_and_size_in_whole_floats(one_rank):
    rows = commcheck.measure(CPU, [1, 8, 10, 4096], iters=2)
    assert [(op, nbytes) for op, nbytes, *_ in rows] == [
        (op, nbytes) for op in ("all_reduce", "all_gather", "broadcast") for nbytes in (4, 8, 8, 4096)]
    for op, nbytes, seconds, algbw, busbw in rows:
        assert seconds > 0 and algbw == pytest.approx(nbytes / seconds / 1e9)
        assert busbw == (algbw if op == "broadcast" else 0.0), "one rank sends nothing over a link"


@pytest.mark.parametrize("argv, message", [(["--iters", "many"], "--iters: invalid int value: 'many'"),
                                           (["--count", "8"], "unrecognized arguments: --count 8")])
def test_a_bad_flag_is_one_error_line_before_the_group_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as caught:
        commcheck.main(argv)
    assert caught.value.code == 2 and not torch_dist.is_initialized()
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and message in errors[0], errors


@pytest.mark.parametrize("argv, message", [(["--sizes", "8,1k"], "--sizes 8,1k: give whole numbers of bytes"),
                                           (["--iters", "0"], "take numbers of 1 or more"),
                                           (["--sizes", "0"], "take numbers of 1 or more")])
def test_sizes_and_repetitions_that_cannot_be_measured_are_one_error_line_before_the_group_starts(argv, message,
                                                                                                   capsys):
    assert commcheck.main(argv) == 2 and not torch_dist.is_initialized()
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], errors


@pytest.mark.parametrize("world", [1, 2, 3, 15, 16, 21, 35, 64, 512])
def test_the_product_check_is_exact_in_fp32_at_any_world_size(world):
    """A 2x8-GPU cluster has 16 ranks: 1 x 2 x ... x 16 in fp32, reduced in any order, is not the one rounding of
    the exact product (and 21! overflows int64), so a healthy cluster failed the check. Each order a reduction may
    take (here: from each rank in turn, around the ring) gives the expected value."""
    terms = torch.tensor([commcheck.product_term(rank) for rank in range(world)], dtype=torch.float32)
    for start in range(min(world, 8)):
        product = torch.ones((), dtype=torch.float32)
        for term in terms.roll(-start):
            product = product * term
        assert product.item() == commcheck.product_want(world)
