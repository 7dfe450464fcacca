"""Where the app touches transformers' private internals (written against transformers 5.17-5.23)."""
import contextlib

import torch


@contextlib.contextmanager
def unpacked_positions(given=()):
    """transformers' masks made on fake tensors as a real eager run makes them. Its mask code asks whether the
    position ids pack several sequences into a row (masking_utils.find_packed_sequence_indices) and, unable to read a
    fake tensor, answers "maybe": it then builds the whole causal mask, which SDPA keeps as an additive mask per
    layer (8.6 GB for llama-1b at 16,384 tokens). Within this, the positions a model makes itself (0, 1, 2, ... along
    each row) get a real run's answer, one sequence a row, and SDPA's is_causal keeps no mask; positions in `given`
    (views of the same storage too: a packed run's, which restart within a row) keep transformers' answer, and its
    mask, as a real packed run does (on fake tensors, positions given are counted as packed)."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    asked, storages = masking_utils.find_packed_sequence_indices, {_storage(t) for t in given if _storage(t)}
    masking_utils.find_packed_sequence_indices = lambda position_ids: (
        asked(position_ids) if _storage(position_ids) in storages else None)
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = asked


def _storage(tensor) -> int:
    """The id of tensor's storage (0 for anything else)."""
    return tensor.untyped_storage()._cdata if isinstance(tensor, torch.Tensor) else 0
