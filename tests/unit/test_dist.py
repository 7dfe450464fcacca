"""Run time in one process: who this rank is from the launcher's variables before the group exists, printing from
the main rank only, and collectives that leave values as they are without a group. Across real gloo ranks:
tests/e2e/test_dist.py."""
import torch

from app.distributed import dist


def test_before_the_group_exists_the_launcher_variables_say_who_we_are(monkeypatch):
    assert not torch.distributed.is_initialized()
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert (dist.rank(), dist.world_size(), dist.is_main()) == (2, 4, False)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    assert (dist.rank(), dist.world_size(), dist.is_main()) == (0, 1, True)


def test_print0_speaks_on_the_main_rank_only(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    dist.print0("from rank 1")
    monkeypatch.setenv("RANK", "0")
    dist.print0("from rank 0")
    assert capsys.readouterr().out == "from rank 0\n"


def test_without_a_group_the_collectives_leave_values_as_they_are():
    assert not torch.distributed.is_initialized()
    assert dist.host_sum([1.0, 5.0]) == [1.0, 5.0] and dist.host_max([3, 2]) == [3.0, 2.0]
    sent = {"a": [1, 2]}
    assert dist.broadcast_object(sent) is sent and dist.gather_objects(sent) == [sent]
    dist.barrier()
    ran = []
    with dist.main_process_first():
        ran.append(True)
    assert ran == [True]
    dist.teardown()  # safe when no group exists
