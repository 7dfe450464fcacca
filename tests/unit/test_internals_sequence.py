"""DeepSpeed's sequence-parallel groups and the Ulysses attention in transformers' registry
(app/ds/internals/sequence.py), in one process."""
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from app.ds.internals.sequence import forget_sequence_groups, sequence_groups


def test_no_groups_without_sequence_parallelism():
    assert sequence_groups({}) is None and sequence_groups({"sequence_parallel_size": 1}) is None


def test_forgetting_puts_the_core_attention_back():
    core = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def wrapped(*args, **kwargs):
        return core(*args, **kwargs)
    wrapped.app_core = core
    ALL_ATTENTION_FUNCTIONS["sdpa"] = wrapped
    try:
        forget_sequence_groups()
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is core
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = core
