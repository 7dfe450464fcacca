"""The rank layout a ds_config asks for: which replica's data each rank loads, on data, pipeline and tensor
parallelism."""
import json

import pytest

from app.parallel import layout as parallel
from app.errors import UserError
from conftest import REPO


def _config(name: str) -> dict:
    return json.loads((REPO / "ds_configs" / f"{name}.json").read_text())


@pytest.mark.parametrize("name, world, replicas, by_rank", [
    ("dp", 4, 4, [0, 1, 2, 3]),               # every rank its own replica
    ("pipeline", 4, 2, [0, 1, 0, 1]),         # pipe-major: ranks 0,1 are stage 0 of replicas 0,1
    ("tensor_parallel", 4, 2, [0, 0, 1, 1]),  # a shard group is consecutive ranks
])
def test_each_rank_loads_its_replicas_data(name, world, replicas, by_rank):
    layouts = [parallel.rank_layout(_config(name), world, rank, name) for rank in range(world)]
    assert [layout.replica for layout in layouts] == by_rank
    assert {layout.replicas for layout in layouts} == {replicas}


def test_the_layout_names_its_split():
    assert parallel.rank_layout(_config("pipeline"), 2, 0, "p").split.stages == 2
    assert parallel.rank_layout(_config("tensor_parallel"), 2, 0, "t").tensor == 2
    plain = parallel.rank_layout(_config("dp"), 2, 0, "dp")
    assert plain.split is None and plain.tensor == 1


def test_a_split_the_world_cannot_hold_is_refused_before_anything_is_built():
    with pytest.raises(UserError, match="pipeline.stages 2 does not divide the world size 3"):
        parallel.rank_layout(_config("pipeline"), 3, 0, "pipeline.json")
    with pytest.raises(UserError, match="autotp_size 2 does not divide the world size 1"):
        parallel.rank_layout(_config("tensor_parallel"), 1, 0, "tensor_parallel.json")
