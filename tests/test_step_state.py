"""A call's outputs reach the host from contiguous device tensors only: TorchNeuron makes a strided device
view contiguous with an eager kernel compiled per shape (fake TorchNeuron's rule (f))."""

import torch

from worker.step_state import CallOutputs


def contiguous_only(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.is_contiguous(), f"a strided view {tuple(tensor.shape)} {tensor.stride()} reached the host"
    return tensor.clone()


def test_a_verify_calls_rows_come_to_the_host_whole_and_are_stepped_through_there():
    rows, queries, padded, vocab = 2, 3, 8, 5
    top_ids = torch.arange(padded * 21).view(padded, 21)
    row = torch.arange(padded)
    out = CallOutputs([4, 1], torch.randn(padded, vocab), row, top_ids, top_ids.float(), row, row, queries)
    assert out.real(out.token_ids, contiguous_only).tolist() == [0, 3]  # each row's first query
    top = out.real(out.logprob_token_ids, contiguous_only)[:, :4]  # the columns cut on the host
    assert top.tolist() == [list(range(0, 4)), list(range(63, 67))]
    assert out.real(out.logits, contiguous_only).shape == (rows, vocab)
    assert contiguous_only(out.all_queries(out.token_ids)).tolist() == [[0, 1, 2], [3, 4, 5]]
