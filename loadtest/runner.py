"""How requests go out: a fixed number in flight, or Poisson arrivals; warm-up first (not measured);
a run ends after its request count or its duration, whichever comes first."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from loadtest.client import Target, make_client, send
from loadtest.metrics import MetricsWatcher
from loadtest.stats import RequestRecord, level_summary, measured_window
from loadtest.workload import RequestSpec, Workload, poisson_arrivals


class Clock:
    """Real time; tests give the dispatcher a fake one."""

    def now(self) -> float:
        return time.perf_counter()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


@dataclass
class Level:
    """One measured run: `concurrency` requests in flight, or Poisson arrivals at `rate` per second with
    at most `concurrency` in flight."""

    concurrency: int
    rate: float | None = None
    requests: int | None = 100
    duration_s: float | None = None
    warmup: int = 2

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}/s" if self.rate else f"concurrency {self.concurrency}"


@dataclass
class LevelResult:
    level: Level
    records: list[RequestRecord]
    summary: dict[str, object]
    server: dict[str, object] | None = None
    late_s: list[float] = field(default_factory=list)  # Poisson: how late each send was


async def dispatch_concurrent(
    send_one: Callable[[int], Awaitable[None]],
    indices: Iterable[int],
    concurrency: int,
    deadline: float | None,
    clock: Clock,
) -> None:
    """`concurrency` workers, each sending its next request as soon as its previous one ends."""
    pending = iter(indices)

    async def worker() -> None:
        for index in pending:  # shared iterator: each index goes to exactly one worker
            if deadline is not None and clock.now() >= deadline:
                return
            await send_one(index)

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def dispatch_poisson(
    send_one: Callable[[int], Awaitable[None]],
    indices: Iterable[int],
    arrivals: Iterable[float],
    max_in_flight: int,
    deadline: float | None,
    clock: Clock,
) -> list[float]:
    """Send request k at start + arrivals[k] (a schedule fixed in advance, so one slow response does not
    shift later arrivals); if `max_in_flight` are out, the send waits for one to end. Returns each send's
    lateness in seconds."""
    start = clock.now()
    slots = asyncio.Semaphore(max_in_flight)
    tasks: list[asyncio.Task] = []
    late: list[float] = []

    async def one(index: int) -> None:
        try:
            await send_one(index)
        finally:
            slots.release()

    for index, moment in zip(indices, arrivals, strict=False):
        wait = start + moment - clock.now()
        if wait > 0:
            await clock.sleep(wait)
        if deadline is not None and clock.now() >= deadline:
            break
        await slots.acquire()
        if deadline is not None and clock.now() >= deadline:  # the wait for a slot ran past it
            slots.release()
            break
        late.append(clock.now() - (start + moment))
        tasks.append(asyncio.create_task(one(index)))
    await asyncio.gather(*tasks)
    return late


async def run_level(
    target: Target,
    workload: Workload,
    level: Level,
    *,
    first_index: int,
    seed: int = 0,
    timeout_s: float = 600.0,
    metrics_interval_s: float = 2.0,
    progress: bool = True,
    dollars_per_hour: float | None = None,
    clock: Clock | None = None,
) -> LevelResult:
    """Warm-up, then the measured run with the server's metrics watched. Request indices start at
    first_index (warm-up first), so levels of one sweep never send the same prompt twice. Given the hourly
    charge of what the server runs on, the summary has the run's cost."""
    clock = clock or Clock()
    async with make_client(level.concurrency, timeout_s) as client:
        # Warm-up: connections opened and first-request costs paid before anything is measured.
        warm_slots = asyncio.Semaphore(level.concurrency)

        async def warm_one(spec: RequestSpec) -> None:
            async with warm_slots:
                await send(client, target, spec)

        await asyncio.gather(*(warm_one(workload.request(first_index + i)) for i in range(level.warmup)))
        specs = _measured_specs(workload, first_index + level.warmup, level.requests)
        watcher = MetricsWatcher(client, target.base_url, metrics_interval_s)
        await watcher.start()
        records: list[RequestRecord] = []
        bar = _progress_bar(level, progress)

        async def send_one(index: int) -> None:
            records.append(await send(client, target, specs(index)))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(errors=sum(not r.ok for r in records), refresh=False)

        deadline = clock.now() + level.duration_s if level.duration_s else None
        indices = _indices(first_index + level.warmup, level.requests)
        late: list[float] = []
        try:
            if level.rate:
                arrivals = poisson_arrivals(level.rate, random.Random(f"arrivals:{seed}:{first_index}"))
                late = await dispatch_poisson(send_one, indices, arrivals, level.concurrency, deadline, clock)
            else:
                await dispatch_concurrent(send_one, indices, level.concurrency, deadline, clock)
        finally:
            if bar is not None:
                bar.close()
        server = await watcher.stop()
    summary = level_summary(records, measured_window(records), dollars_per_hour)
    return LevelResult(level, records, summary, server, late)


def _indices(first: int, count: int | None) -> Iterable[int]:
    if count is not None:
        return range(first, first + count)
    return _count_from(first)


def _count_from(first: int) -> Iterable[int]:
    index = first
    while True:
        yield index
        index += 1


def _measured_specs(workload: Workload, first: int, count: int | None) -> Callable[[int], RequestSpec]:
    # Drawn up front when the count is known, so building prompts does not take time between sends.
    if count is None:
        return workload.request
    drawn = {i: workload.request(i) for i in range(first, first + count)}
    return lambda index: drawn[index]


def _progress_bar(level: Level, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=level.requests, desc=level.label, unit="req", leave=False, dynamic_ncols=True)
