"""A model of the steps the plugin's scheduler makes and the calls the runner makes of them. Pure Python.

`SchedulerModel` is vLLM's v1 scheduler with chunked prefill as `NeuronScheduler` runs it: running requests
in order, then waiting ones admitted while fewer than max_num_seqs run, within the step's token budget; under
light load the budget and every chunk are capped by `prefill_share`, the rule the scheduler itself
calls. The KV cache is assumed large enough (no preemption) and nothing hits the prefix cache. A step is
recorded as the runner receives it (`SimulatedStep`: decode rows and prefill chunks in batch order, with
admission order standing in for the runner's batch order), before bucketing, and `calls.plan_step` turns it
into calls.

- `scripted_calls`: the calls of a scripted workload (arrivals and cancellations at given steps), to check
  the model against the runner;
- `traffic_steps`: the steps of a closed-loop run of a `TrafficShape`, what the bucket policy fits to.
"""

from collections import deque
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from vllm_neuron.buckets import BucketConfig
from vllm_neuron.calls import Call, plan_step
from vllm_neuron.planning.traffic import TrafficShape, load_at, sample_requests
from vllm_neuron.prefill_share import prefill_share


@dataclass(frozen=True)
class SimulatedStep:
    """One scheduler step as the runner receives it: each decode row's context (position + 1) and each
    prefill chunk's (start, length), in batch order. `repeat` > 1 stands for that many consecutive steps of
    the same decode rows and no chunks, each row's context one more at every step."""

    decode_contexts: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]
    repeat: int = 1

    def unrolled(self) -> Iterator["SimulatedStep"]:
        for offset in range(self.repeat):
            yield SimulatedStep(tuple(context + offset for context in self.decode_contexts), self.chunks)


@dataclass
class _Request:
    prompt: int
    output: int
    computed: int = 0  # tokens with KV in the cache
    generated: int = 0

    @property
    def decoding(self) -> bool:
        return self.computed >= self.prompt


class SchedulerModel:
    """Requests in flight and the steps `NeuronScheduler` gives them (see the module docstring)."""

    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, prefill_tokens_while_decoding: int):
        self.max_num_seqs = max_num_seqs
        self.full_budget = max_num_batched_tokens
        self.prefill_tokens_while_decoding = prefill_tokens_while_decoding
        self.requests: dict[Hashable, _Request] = {}
        self.waiting: deque[Hashable] = deque()
        self.running: list[Hashable] = []  # admission order

    @property
    def in_flight(self) -> int:
        return len(self.running) + len(self.waiting)

    def add(self, key: Hashable, prompt: int, output: int) -> None:
        self.requests[key] = _Request(prompt, output)
        self.waiting.append(key)

    def cancel(self, key: Hashable) -> None:
        if key in self.running:
            self.running.remove(key)
        elif key in self.waiting:
            self.waiting.remove(key)
        self.requests.pop(key, None)

    def step(self) -> tuple[SimulatedStep, list[Hashable]]:
        """Schedule and run one step: the step, and the requests that finished in it."""
        return self._run(self._schedule(), repeat=1)

    def decode_only_steps(self) -> int:
        """How many coming steps are plain decode steps of exactly the running requests (0 if the next one
        is not): every running request is past its prompt and nobody can be admitted, until one finishes."""
        if not self.running or (self.in_flight > len(self.running) and len(self.running) < self.max_num_seqs):
            return 0
        if len(self.running) > self.full_budget:
            return 0
        requests = [self.requests[key] for key in self.running]
        if not all(request.decoding for request in requests):
            return 0
        return min(request.output - request.generated for request in requests)

    def decode_steps(self, count: int) -> tuple[SimulatedStep, list[Hashable]]:
        """Run `count` decode-only steps (at most `decode_only_steps()`) in one go: a decode-heavy run would
        otherwise cost a Python iteration per step."""
        assert 0 < count <= self.decode_only_steps(), count
        return self._run([(key, 1) for key in self.running], repeat=count)

    def _schedule(self) -> list[tuple[Hashable, int]]:
        """(request, tokens) of the next step, in batch order."""
        decoding = sum(1 for key in self.running if self.requests[key].decoding)
        share = prefill_share(
            decoding,
            self.in_flight - decoding,
            self.max_num_seqs,
            self.prefill_tokens_while_decoding,
            self.full_budget,
        )
        # As NeuronScheduler does: the step's budget leaves the decode rows theirs, and every chunk is capped
        # too (long_prefill_token_threshold), so a chunk ahead of decoding requests cannot take their tokens.
        budget = min(self.full_budget, decoding + share) if share else self.full_budget
        scheduled: list[tuple[Hashable, int]] = []

        def take(key: Hashable, wanted: int) -> None:
            nonlocal budget
            count = min(wanted, share or wanted, budget)
            scheduled.append((key, count))
            budget -= count

        for key in self.running:
            if budget == 0:
                break
            request = self.requests[key]
            take(key, 1 if request.decoding else request.prompt - request.computed)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            key = self.waiting.popleft()
            self.running.append(key)
            take(key, self.requests[key].prompt)
        return scheduled

    def _run(
        self, scheduled: list[tuple[Hashable, int]], repeat: int
    ) -> tuple[SimulatedStep, list[Hashable]]:
        # The runner's rule: a 1-token request is a decode row, any other a prefill chunk.
        step = SimulatedStep(
            tuple(self.requests[key].computed + 1 for key, count in scheduled if count == 1),
            tuple((self.requests[key].computed, count) for key, count in scheduled if count > 1),
            repeat,
        )
        finished = []
        for key, count in scheduled:
            request = self.requests[key]
            was_decoding = request.decoding
            request.computed += count * repeat
            if not request.decoding:
                continue
            request.generated += repeat if was_decoding else 1  # every step past the prompt samples a token
            if request.generated >= request.output:
                self.running.remove(key)
                del self.requests[key]
                finished.append(key)
        return step, finished


def scripted_calls(
    arrivals: Mapping[int, Sequence[tuple[Hashable, int, int]]],
    buckets: BucketConfig,
    *,
    steps: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    block_size: int,
    cancellations: Mapping[int, Sequence[Hashable]] | None = None,
) -> list[list[Call]]:
    """The calls the runner makes at each of `steps` steps of a scripted workload under the buckets' prefill
    share: `arrivals` maps a step to the (request id, prompt tokens, max tokens) that arrive before it is
    scheduled, `cancellations` a step to the request ids cancelled before it."""
    model = SchedulerModel(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_tokens_while_decoding=buckets.prefill_tokens_while_decoding,
    )
    calls = []
    for number in range(steps):
        for key, prompt, output in arrivals.get(number, ()):
            model.add(key, prompt, output)
        for key in (cancellations or {}).get(number, ()):
            model.cancel(key)
        step, _ = model.step()
        plans = plan_step(step.decode_contexts, step.chunks, buckets, block_size)
        calls.append([plan.call for plan in plans])
    return calls


def traffic_steps(
    traffic: TrafficShape,
    *,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    prefill_tokens_while_decoding: int,
    num_requests: int,
    seed: int,
) -> Iterator[SimulatedStep]:
    """The steps of a run until `num_requests` requests have finished, consecutive decode-only steps as
    one `SimulatedStep` with a repeat. Clients keep requests in flight and replace a finished one at once:
    `traffic.concurrency` of them for the first part of the run, then lighter loads (`traffic.load_at`).
    Deterministic for a seed."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be positive, got {num_requests}")
    # Enough requests that arrivals never run dry before `num_requests` have finished.
    prompts, outputs = sample_requests(traffic, max_model_len, num_requests + traffic.concurrency, seed)
    model = SchedulerModel(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        prefill_tokens_while_decoding=prefill_tokens_while_decoding,
    )
    for index in range(traffic.concurrency):
        model.add(index, prompts[index], outputs[index])
    next_arrival, finished = traffic.concurrency, 0
    while finished < num_requests:
        repeat = model.decode_only_steps()
        step, done = model.decode_steps(repeat) if repeat else model.step()
        yield step
        for _ in done:
            finished += 1
            # Top up to the load of this part of the run (lighter loads only stop replacing requests).
            target = load_at(traffic.concurrency, next_arrival, num_requests)
            while next_arrival < len(prompts) and model.in_flight < target:
                model.add(next_arrival, prompts[next_arrival], outputs[next_arrival])
                next_arrival += 1
