"""A call's outputs reach the host from contiguous device tensors only: TorchNeuron makes a strided device
view contiguous with an eager kernel compiled per shape (fake TorchNeuron's rule (f)). The reads the device
thread started are used once their fence is passed, and counted as the step's bytes to the host."""

import torch

from worker.step.step_state import CallOutputs, ToHost


class ContiguousOnly(ToHost):
    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        assert tensor.is_contiguous(), f"a strided view {tuple(tensor.shape)} {tensor.stride()} read"
        return super().__call__(tensor).clone()


class Fence:
    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def test_a_verify_calls_rows_come_to_the_host_whole_and_are_stepped_through_there():
    rows, queries, padded, vocab = 2, 3, 8, 5
    top_ids = torch.arange(padded * 21).view(padded, 21)
    row = torch.arange(padded)
    out = CallOutputs([4, 1], torch.randn(padded, vocab), row, top_ids, top_ids.float(), row, row, queries)
    to_host = ContiguousOnly()
    assert out.real("token_ids", to_host).tolist() == [0, 3]  # each row's first query
    top = out.real("logprob_token_ids", to_host)[:, :4]  # the columns cut on the host
    assert top.tolist() == [list(range(0, 4)), list(range(63, 67))]
    assert out.real("logits", to_host).shape == (rows, vocab)
    assert out.all_queries("token_ids", to_host).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert to_host.bytes == 8 * (6 + 6 * 21 + 6) + 4 * 6 * vocab  # every query's row, every column


def test_a_started_read_is_used_once_its_fence_is_passed():
    row = torch.arange(4)
    out = CallOutputs([0, 1], torch.zeros(4, 3), row, row, row, row, row)
    started = torch.tensor([7, 8])  # what the device thread's read brought
    out.reads["token_ids"], out.fence = started, Fence()
    to_host = ContiguousOnly()
    assert out.real("token_ids", to_host).tolist() == [7, 8]
    assert out.fence.waits == 1 and to_host.bytes == 16
    assert out.real("ranks", to_host).tolist() == [0, 1]  # not started: read now


def test_a_part_of_the_logits_comes_from_the_started_read_where_there_is_one():
    row = torch.arange(4)
    logits = torch.arange(12.0).view(4, 3)
    out = CallOutputs([0, 1], logits, row, row, row, row, row)
    to_host = ContiguousOnly()
    assert out.part("logits", slice(1, 2), to_host).tolist() == [[3.0, 4.0, 5.0]]  # read now: one row
    assert to_host.bytes == 3 * 4
    out.reads["logits"], out.fence = logits[:2] * 10, Fence()
    assert out.part("logits", slice(1, 2), to_host).tolist() == [[30.0, 40.0, 50.0]]
    assert out.fence.waits == 1
