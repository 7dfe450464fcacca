"""Launch time for real: DeepSpeed takes the device the rank chose, not the one numbered LOCAL_RANK, under ZeRO-3,
a pipeline and AutoTP. Launcher detection, variables and node names: tests/unit/test_launch.py."""
import json


from app.distributed import launch
from conftest import REPO, spawn_ranks, write_text_rows


def _devices_deepspeed_asks_for(rank, world, out, corpus):
    """Train ZeRO-3 (a transformers model built under zero.Init), a pipeline and AutoTP with LOCAL_RANK one above
    what a launcher binding one GPU per task leaves visible (its index 0); record every device index that
    reaches DeepSpeed's accelerator."""
    import os
    import time
    from deepspeed.accelerator import get_accelerator
    from app import train as app_train
    from app import settings as config
    from app.distributed import dist
    os.environ["LOCAL_RANK"] = str(rank + 1)
    accelerator, asked = get_accelerator(), []
    name = accelerator.device_name
    accelerator.set_device = lambda index: asked.append(("set_device", str(index)))
    accelerator.device_name = lambda index=None: (asked.append(("device_name", str(index))) if index is not None
                                                  else None, name(index))[1]
    launch.prepare_environment()
    jobs = [config.parse(["--deepspeed_config", str(REPO / "ds_configs" / f"{name}.json"), "--model", model,
                          "--dataset", str(corpus), "--block_size", "16", "--max_steps", "2", "--output_dir",
                          str(out / name)])
            for name, model in (("zero3", "llama-tiny"), ("pipeline", "gpt2-tiny"), ("tensor_parallel", "llama-tiny"))]
    world_info = launch.setup(timeout_s=120)
    for settings, ds in jobs:
        asked.append(("exit", str(app_train.run(settings, ds, world_info, time.perf_counter()))))
    dist.teardown()
    (out / f"asked{rank}.json").write_text(json.dumps(asked))


def test_deepspeed_takes_the_device_the_rank_chose_not_the_one_numbered_local_rank(tmp_path):
    corpus = write_text_rows(tmp_path / "corpus.txt", 200)
    spawn_ranks(2, _devices_deepspeed_asks_for, tmp_path, corpus)
    for rank in range(2):
        asked = json.loads((tmp_path / f"asked{rank}.json").read_text())
        assert [code for kind, code in asked if kind == "exit"] == ["0", "0", "0"], asked
        kinds = {kind for kind, _ in asked}
        assert {"set_device", "device_name"} <= kinds, "the engine, zero.Init and the pipeline name a device"
        assert {index for kind, index in asked if kind != "exit"} == {"0"}, asked
