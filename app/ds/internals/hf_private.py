"""Where the app touches transformers' private internals (written against transformers 5.17-5.23)."""
import contextlib


@contextlib.contextmanager
def unpacked_positions():
    """transformers' masks made as an eager run of rows that pack one sequence each makes them, also on fake tensors.
    Its mask code asks whether the position ids pack several sequences into a row
    (masking_utils.find_packed_sequence_indices) and, unable to read a fake tensor, answers "maybe": it then builds
    the whole causal mask, which SDPA keeps as an additive mask per layer (8.6 GB for llama-1b at 16,384 tokens), where
    a real run of unpacked rows passes none (SDPA's is_causal). Within this, the answer is a real run's for positions
    that count 0, 1, 2, ... along each row (the model's own when it is given none): one sequence a row."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    asked = masking_utils.find_packed_sequence_indices
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = asked
