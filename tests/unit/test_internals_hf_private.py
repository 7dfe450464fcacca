"""transformers' internals the app relies on (app/ds/internals/hf_private.py)."""
import torch

from app.ds import internals as ds_internals
from app.ds.internals import torch_private


def test_fake_positions_of_one_sequence_a_row_are_found_unpacked_within_and_only_there():
    from transformers import masking_utils
    with torch_private.fake_tensor_mode():
        positions = torch.arange(16).unsqueeze(0)
        assert masking_utils.find_packed_sequence_indices(positions) is not None  # transformers cannot tell
        with ds_internals.unpacked_positions():
            assert masking_utils.find_packed_sequence_indices(positions) is None
        assert masking_utils.find_packed_sequence_indices(positions) is not None


def test_given_positions_keep_transformers_answer_and_the_models_own_are_unpacked():
    """A packed run's position ids (given, or a view of them) are asked as transformers asks; any others, the ones a
    model makes itself, are one sequence a row."""
    from transformers import masking_utils
    with torch_private.fake_tensor_mode():
        given, own = torch.arange(16).remainder(8).unsqueeze(0), torch.arange(16).unsqueeze(0)
        with ds_internals.unpacked_positions([torch.zeros(1, 16, dtype=torch.long), given, None]):
            assert masking_utils.find_packed_sequence_indices(given) is not None
            assert masking_utils.find_packed_sequence_indices(given.view(1, 16)) is not None
            assert masking_utils.find_packed_sequence_indices(own) is None


def test_the_answer_is_transformers_own_again_after_an_error():
    from transformers import masking_utils
    asked = masking_utils.find_packed_sequence_indices
    try:
        with ds_internals.unpacked_positions():
            raise KeyError("inside")
    except KeyError:
        pass
    assert masking_utils.find_packed_sequence_indices is asked
