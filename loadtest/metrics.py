"""The target's own view of a run: /v1/neuron/info (is it ours?) and /metrics, scraped before, during
and after. Counters are reported as deltas over the run, gauges as their peak and mean while it ran."""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import httpx

from vllm_neuron import acceptance

Labels = tuple[tuple[str, str], ...]
Samples = dict[tuple[str, Labels], float]

# Counters whose change over a run is reported; the plugin's first, then vLLM's.
COUNTERS = (
    "vllm_neuron:unexpected_recompiles_total",
    "vllm_neuron:padding_real_tokens_total",
    "vllm_neuron:padding_slots_total",
    "vllm_neuron:bucket_calls_total",
    "vllm_neuron:compile_seconds_total",
    "vllm_neuron:step_seconds_sum",
    "vllm_neuron:step_seconds_count",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:num_preemptions_total",
    "vllm:request_success_total",
    *acceptance.COUNTERS,
)
GAUGES = (
    "vllm_neuron:kv_blocks_used",
    "vllm_neuron:kv_blocks_total",
    "vllm_neuron:compiled_graphs",
    "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> Samples:
    """Prometheus text exposition -> {(name, sorted labels): value}. Comments and odd lines are skipped."""
    samples: Samples = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        # vLLM labels its series with the model and engine; those say nothing about the run, so they go.
        pairs = tuple(
            sorted((k, v) for k, v in _LABEL.findall(labels or "") if k not in ("model_name", "engine"))
        )
        samples[(name, pairs)] = samples.get((name, pairs), 0.0) + number
    return samples


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    """Values of one series keyed by one label's value (summed over the others)."""
    out: dict[str, float] = {}
    for (sample_name, labels), value in samples.items():
        if sample_name == name:
            key = dict(labels).get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out


def total(samples: Samples, name: str) -> float | None:
    values = [value for (sample_name, _), value in samples.items() if sample_name == name]
    return sum(values) if values else None


def deltas(before: Samples, after: Samples, names: Iterable[str] = COUNTERS) -> Samples:
    wanted = set(names)
    return {key: value - before.get(key, 0.0) for key, value in after.items() if key[0] in wanted}


@dataclass
class GaugeTrack:
    """Gauges sampled while a run goes on: peak and mean of each series."""

    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, samples: Samples) -> None:
        for name in GAUGES:
            value = total(samples, name)
            if value is not None and not math.isnan(value):
                self.values.setdefault(name, []).append(value)

    def summary(self) -> dict[str, dict[str, float]]:
        return {
            name: {"max": max(vs), "mean": sum(vs) / len(vs), "samples": len(vs)}
            for name, vs in self.values.items()
        }


def run_summary(before: Samples, after: Samples, gauges: GaugeTrack) -> dict[str, object]:
    """What the server says about one run: counter deltas, padding efficiency per phase, step time per
    part, recompiles, KV usage."""
    change = deltas(before, after)
    real = by_label(change, "vllm_neuron:padding_real_tokens_total", "phase")
    slots = by_label(change, "vllm_neuron:padding_slots_total", "phase")
    step_sum = by_label(change, "vllm_neuron:step_seconds_sum", "part")
    step_count = by_label(change, "vllm_neuron:step_seconds_count", "part")
    summary: dict[str, object] = {
        "plugin_series": any(name.startswith("vllm_neuron:") for name, _ in after),
        "unexpected_recompiles": total(change, "vllm_neuron:unexpected_recompiles_total"),
        "padding_efficiency": {phase: real.get(phase, 0.0) / n for phase, n in slots.items() if n > 0},
        "padding_real_tokens": real,
        "padding_slots": slots,
        "step_seconds": {part: step_sum[part] for part in step_sum},
        "step_ms_mean": {
            part: 1e3 * step_sum[part] / step_count[part] for part in step_sum if step_count.get(part)
        },
        "bucket_calls": by_label(change, "vllm_neuron:bucket_calls_total", "bucket"),
        "prompt_tokens": total(change, "vllm:prompt_tokens_total"),
        "generation_tokens": total(change, "vllm:generation_tokens_total"),
        "preemptions": total(change, "vllm:num_preemptions_total"),
        # Speculative decoding over the run (None: the server runs none).
        "speculative": acceptance.figures(*(total(change, name) or 0.0 for name in acceptance.COUNTERS))
        if total(after, acceptance.DRAFTS) is not None
        else None,
        "gauges": gauges.summary(),
    }
    return summary


class MetricsWatcher:
    """Scrapes /metrics at the start, every `interval_s` during, and at the end of a run."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval_s: float = 2.0) -> None:
        self.client, self.url, self.interval_s = client, base_url + "/metrics", interval_s
        self.available = True
        self._before: Samples = {}
        self._gauges = GaugeTrack()
        self._task: asyncio.Task | None = None

    async def scrape(self) -> Samples:
        if not self.available:
            return {}
        try:
            response = await self.client.get(self.url, timeout=10)
        except httpx.HTTPError:
            return {}
        if response.status_code != 200:
            self.available = False  # no /metrics (or not for us): stop asking
            return {}
        return parse_prometheus(response.text)

    async def start(self) -> None:
        self._before = await self.scrape()
        self._gauges = GaugeTrack()
        self._task = asyncio.create_task(self._poll()) if self.available else None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self._gauges.add(await self.scrape())

    async def stop(self) -> dict[str, object] | None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        after = await self.scrape()
        if not self.available or not after:
            return None
        return run_summary(self._before, after, self._gauges)


async def neuron_info(client: httpx.AsyncClient, base_url: str, headers: dict[str, str]) -> dict | None:
    """The plugin's /v1/neuron/info, or None when the target is not ours."""
    try:
        response = await client.get(base_url + "/v1/neuron/info", headers=headers, timeout=10)
        return response.json() if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None
