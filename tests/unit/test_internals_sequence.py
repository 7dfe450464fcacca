"""DeepSpeed's sequence-parallel groups and the Ulysses attention in transformers' registry
(app/ds/internals/sequence.py), in one process."""
import pytest
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from app.ds.internals.sequence import forget_sequence_groups, sequence_groups, whole_sequences


def test_no_groups_without_sequence_parallelism():
    assert sequence_groups({}) is None and sequence_groups({"sequence_parallel_size": 1}) is None


@pytest.fixture
def wrapped():
    """sdpa's entry of transformers' registry wrapped as the Ulysses attention is (its core kept); put back after."""
    core = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def ulysses(*args, **kwargs):
        return core(*args, **kwargs)
    ulysses.app_core = core
    ALL_ATTENTION_FUNCTIONS["sdpa"] = ulysses
    yield ulysses
    ALL_ATTENTION_FUNCTIONS["sdpa"] = core


def test_forgetting_puts_the_core_attention_back(wrapped):
    forget_sequence_groups()
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is wrapped.app_core


def test_whole_sequences_attend_through_the_core_until_the_block_ends_even_by_an_error(wrapped):
    """GRPO samples each completion whole on one rank: inside the block the registry holds the core attention,
    after it (an error included) the Ulysses one again."""
    with whole_sequences():
        assert ALL_ATTENTION_FUNCTIONS["sdpa"] is wrapped.app_core
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is wrapped
    with pytest.raises(RuntimeError), whole_sequences():
        raise RuntimeError("sampling failed")
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is wrapped
