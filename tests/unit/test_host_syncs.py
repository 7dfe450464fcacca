"""The host-sync counter (tests/helpers/host_syncs.py) in one process: it sees every kind of host synchronisation
and counts them by optimizer step. No step of any shipped ds_config waits on the device:
tests/e2e/test_host_syncs.py."""
import torch

from helpers.host_syncs import HostSyncs, _source


def _sync_everywhere(x):
    from deepspeed.accelerator import get_accelerator
    torch.tensor(-1.0, device=x.device)  # a copy from the host on a GPU
    if not get_accelerator().resolves_data_dependency():  # skipped on a CPU; on CUDA the host waits here
        get_accelerator().current_stream().synchronize()
    if not get_accelerator().resolves_data_dependency():  # no wait behind this guard: not counted
        pass
    mask = x > 0
    x.sum().item()
    bool(x.sum() > 0)
    float(x[0])
    int(x[1])
    x.tolist()
    x.cpu()
    x.numpy()
    x.nonzero()
    x[mask]
    torch.unique(x)
    [0, 1, 2][x[0].long()]
    x.clone().masked_fill_(mask, torch.tensor(-1.0))  # CUDA's kernel reads the value on the host
    x.clone().masked_fill_(mask, -1.0)  # a number: nothing to read


def test_the_counter_sees_every_kind_of_host_sync_and_counts_by_step():
    x = torch.tensor([1.0, 2.0, 0.0])
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    with HostSyncs(torch.device("cpu")) as counter:
        _sync_everywhere(x)
        (weight * x).sum().backward()
        optimizer.step()  # window 0 ends here
        (weight * x * 2).sum().backward()  # plain computation: nothing to count
        optimizer.step()
        weight.grad.sum().item()
        optimizer.step()
    kinds = {source.split(" at ")[0]: count for source, count in counter.windows[0].items()}
    assert kinds == {"item": 1, "__bool__": 1, "__float__": 1, "__int__": 1, "tolist": 1, "cpu": 1, "numpy": 1,
                     "nonzero": 1, "__getitem__": 1, "unique": 1, "__index__": 1, "copy to the device (tensor)": 1,
                     "synchronize (on CUDA)": 1, "masked_fill_": 1}, kinds
    assert all(" at tests/unit/test_host_syncs.py:" in source for source in counter.windows[0])
    assert 1 not in counter.windows and sum(counter.windows[2].values()) == 1
    assert list(counter.per_step(optimizer_steps=3, first=1)) == [1, 2]


def test_a_wait_is_put_on_the_code_that_asked_even_in_an_environment_under_a_torch_folder():
    """An H100 machine kept its environment in /opt/torch/.venv: every DeepSpeed frame there had /torch/ in its path
    and a wait was put on the app's frame that called DeepSpeed's step. Only torch's own folder is passed over."""
    path = "/opt/torch/.venv/lib/python3.12/site-packages/deepspeed/runtime/zero/stage3.py"
    scope = {}
    exec(compile("def _allgather_params_coalesced(ask):\n    return ask()\n", path, "exec"), scope)
    source = scope["_allgather_params_coalesced"](_source)
    assert source == "deepspeed/runtime/zero/stage3.py:2 _allgather_params_coalesced"
