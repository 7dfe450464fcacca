"""Every file in ds_configs/ has its end-to-end run (tests/e2e/test_train.py) or a test that names it."""
from conftest import NOT_FOR_THE_CNN, REPO

CONFIGS = sorted(p.stem for p in (REPO / "ds_configs").glob("*.json") if p.stem not in NOT_FOR_THE_CNN)
STAGE = {"dp": 0, "bf16": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero2_offload": 2, "zero3_offload": 3,
         "pipeline": 0, "activation_checkpointing": 0}


def test_every_config_is_covered():
    """Each ds_configs file trains the digits CNN end to end, or says which test trains it on another model."""
    assert set(CONFIGS) == set(STAGE), "add the new ds_configs file to STAGE so it is run end to end"
    assert all((REPO / "ds_configs" / f"{name}.json").is_file() for name in NOT_FOR_THE_CNN)
