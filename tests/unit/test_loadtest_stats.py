"""The load generator's statistics and scheduling against hand-computed cases; no server, no real time."""

import asyncio
import heapq
import json
import math
import py_compile
import random
import statistics
from pathlib import Path

import httpx
import pytest

from loadtest import report
from loadtest.cli import levels_from, main, parser, price_from
from loadtest.client import COMPLETIONS, Target, chunk_text, send
from loadtest.metrics import GaugeTrack, parse_prometheus, run_summary
from loadtest.runner import Level, LevelResult, dispatch_concurrent, dispatch_poisson
from loadtest.stats import (
    RequestRecord,
    inter_token_latencies,
    level_summary,
    measured_window,
    percentile,
    summarize,
    time_per_output_token,
)
from loadtest.workload import LengthDist, Workload, load_dataset, poisson_arrivals

ROOT = Path(__file__).resolve().parents[2]


# ---- percentiles ---------------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # order must not matter
    # rank = (n - 1) * q / 100 over [1, 2, 3, 4]
    assert percentile(values, 50) == pytest.approx(2.5)  # rank 1.5
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0


def test_percentile_edge_cases():
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)
    # 101 values 0..100: the q-th percentile is q itself.
    assert [percentile(list(range(101)), q) for q in (50, 90, 99)] == [50, 90, 99]


def test_summarize_scales_to_milliseconds():
    summary = summarize([0.010, 0.020, 0.030], scale=1e3)
    assert summary["count"] == 3
    assert summary["mean"] == pytest.approx(20.0)
    assert summary["p50"] == pytest.approx(20.0)
    assert summary["p90"] == pytest.approx(28.0)  # rank 1.8: 20 + 0.8 * 10
    assert summary["p99"] == pytest.approx(29.8)
    assert math.isnan(summarize([])["p50"])


# ---- per-request figures -------------------------------------------------------------------------------


def test_itl_ttft_and_tpot_from_stream_timestamps():
    record = RequestRecord(start=0.5, end=1.7, chunk_times=[1.0, 1.1, 1.3, 1.6], output_tokens=4)
    assert record.ttft == pytest.approx(0.5)
    assert inter_token_latencies(record.chunk_times) == pytest.approx([0.1, 0.2, 0.3])
    assert time_per_output_token(record.start, record.chunk_times, 4) == pytest.approx(0.6 / 3)
    # Chunks carrying several tokens: ITL stays per chunk, TPOT divides by the tokens counted by usage.
    assert time_per_output_token(record.start, record.chunk_times, 7) == pytest.approx(0.1)
    assert time_per_output_token(record.start, [1.0], 1) is None
    assert inter_token_latencies([2.0]) == []
    assert record.latency == pytest.approx(1.2)


def test_level_summary_throughput_and_errors():
    records = [
        RequestRecord(
            start=0.0, end=1.0, chunk_times=[0.2, 0.4, 0.6, 1.0], output_tokens=4, prompt_tokens=10
        ),
        RequestRecord(start=0.5, end=2.0, chunk_times=[1.0, 1.5, 2.0], output_tokens=6, prompt_tokens=20),
        RequestRecord(start=1.0, end=1.1, error="http_500"),
        RequestRecord(start=1.0, end=1.2, error="timeout"),
        RequestRecord(start=1.0, end=1.3, error="http_500"),
    ]
    wall = measured_window(records)
    assert wall == pytest.approx(2.0)
    summary = level_summary(records, wall)
    assert (summary["requests"], summary["completed"], summary["failed"]) == (5, 2, 3)
    assert summary["errors"] == {"http_500": 2, "timeout": 1}
    assert summary["output_tokens"] == 10
    assert summary["prompt_tokens"] == 30
    assert summary["output_tokens_per_s"] == pytest.approx(5.0)  # 10 tokens in 2 s
    assert summary["requests_per_s"] == pytest.approx(1.0)  # failures do not count
    assert summary["ttft_ms"]["p50"] == pytest.approx(350.0)  # TTFTs 200 and 500 ms
    # gaps 200, 200, 400 (first) and 500, 500 (second): sorted 200 200 400 500 500
    assert summary["itl_ms"]["count"] == 5
    assert summary["itl_ms"]["p50"] == pytest.approx(400.0)
    assert summary["itl_ms"]["p90"] == pytest.approx(500.0)
    assert summary["e2e_ms"]["p50"] == pytest.approx(1250.0)  # 1000 and 1500 ms
    assert summary["tpot_ms"]["p50"] == pytest.approx((800 / 3 + 200) / 2)  # 0.8 s / 3 and 1.0 s / 5


def test_empty_level_reports_nan_not_errors():
    summary = level_summary([], 0.0)
    assert summary["completed"] == 0
    assert math.isnan(summary["output_tokens_per_s"])
    priced = level_summary([], 0.0, dollars_per_hour=36.0)
    assert priced["cost_dollars"] == 0.0 and math.isnan(priced["dollars_per_million_output_tokens"])


def test_level_summary_cost():
    records = [
        RequestRecord(start=0.0, end=1.0, chunk_times=[0.5, 1.0], output_tokens=4, prompt_tokens=10),
        RequestRecord(start=0.5, end=2.0, chunk_times=[1.0, 2.0], output_tokens=6, prompt_tokens=20),
        RequestRecord(start=1.0, end=1.5, error="timeout"),
    ]
    assert "dollars_per_million_output_tokens" not in level_summary(records, 2.0)  # no price, no cost
    summary = level_summary(records, 2.0, dollars_per_hour=36.0)
    # $36/h for 2 s is $0.02; 10 output tokens (failures make none) and 30 prompt tokens each divide it.
    assert summary["prompt_tokens_per_s"] == pytest.approx(15.0)
    assert summary["dollars_per_hour"] == 36.0
    assert summary["cost_dollars"] == pytest.approx(0.02)
    assert summary["dollars_per_million_output_tokens"] == pytest.approx(0.02 / 10 * 1e6)  # $2,000
    assert summary["dollars_per_million_prompt_tokens"] == pytest.approx(0.02 / 30 * 1e6)  # $666.67


# ---- arrivals and the dispatchers, on a fake clock -----------------------------------------------------


class FakeClock:
    """Simulated time: a sleep wakes at now + seconds, and time jumps to the earliest wake-up once every
    task is blocked, so concurrent tasks overlap exactly as they would in real time, with no real waiting."""

    def __init__(self) -> None:
        self.t = 0.0
        self._wakeups: list[tuple[float, int, asyncio.Future]] = []
        self._order = 0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        future = asyncio.get_running_loop().create_future()
        self._order += 1
        heapq.heappush(self._wakeups, (self.t + max(0.0, seconds), self._order, future))
        await future

    def run(self, coroutine):
        async def main():
            task = asyncio.ensure_future(coroutine)
            while not task.done():
                for _ in range(50):  # let every runnable task run until it blocks
                    await asyncio.sleep(0)
                if self._wakeups and not task.done():
                    self.t, _, future = heapq.heappop(self._wakeups)
                    future.set_result(None)
            return task.result()

        return asyncio.run(main())


def test_poisson_arrivals_mean_gap_is_one_over_rate():
    arrivals = poisson_arrivals(4.0, random.Random(7))
    times = [next(arrivals) for _ in range(20001)]
    assert times[0] == 0.0
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert all(gap >= 0 for gap in gaps)
    # Exponential gaps: mean 1/rate, standard deviation 1/rate, so 20000 of them give the mean within
    # 0.7% (one sigma); the seeded generator makes the check deterministic.
    assert statistics.fmean(gaps) == pytest.approx(0.25, rel=0.02)
    assert statistics.stdev(gaps) == pytest.approx(0.25, rel=0.03)
    # The same seed, the same schedule; the gaps are the generator's own exponential draws.
    rng = random.Random(7)
    assert gaps[:5] == pytest.approx([rng.expovariate(4.0) for _ in range(5)])
    with pytest.raises(ValueError):
        next(poisson_arrivals(0, random.Random(0)))


def test_poisson_dispatcher_sends_on_schedule():
    clock, sent = FakeClock(), []

    async def send_one(index: int) -> None:
        sent.append((index, clock.now()))
        await clock.sleep(0.05)  # a response takes 50 ms; many may be in flight

    schedule = list(_take(poisson_arrivals(10.0, random.Random(3)), 2000))
    late = clock.run(dispatch_poisson(send_one, range(2000), iter(schedule), 10_000, None, clock))
    assert [index for index, _ in sent] == list(range(2000))
    # Every send at its arrival time: no drift, and the realised rate is the asked one.
    times = [moment for _, moment in sent]
    assert times == pytest.approx(schedule, abs=1e-9)
    assert max(late) == pytest.approx(0.0, abs=1e-9)
    assert statistics.fmean([b - a for a, b in zip(times, times[1:], strict=False)]) == pytest.approx(
        0.1, rel=0.05
    )


def test_poisson_dispatcher_caps_in_flight_and_honours_the_deadline():
    clock, in_flight, peak, sent = FakeClock(), [0], [0], []

    async def send_one(index: int) -> None:
        sent.append(clock.now())
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await clock.sleep(1.0)  # slower than the arrivals: the cap must hold them back
        in_flight[0] -= 1

    arrivals = (0.25 * k for k in range(1000))  # 4 per second
    late = clock.run(dispatch_poisson(send_one, range(1000), arrivals, 2, 10.0, clock))
    assert peak[0] == 2
    # Two slots, each busy 1 s: sends at 0 and 0.25, then each as a slot frees, 1 s after the last use.
    assert sent[:6] == pytest.approx([0.0, 0.25, 1.0, 1.25, 2.0, 2.25])
    assert max(sent) < 10.0
    assert len(sent) == len(late) < 1000
    assert late[-1] > 0  # held back by the cap


def test_concurrency_dispatcher_keeps_n_in_flight_and_sends_each_once():
    clock, in_flight, peak, sent = FakeClock(), [0], [0], []

    async def send_one(index: int) -> None:
        sent.append(index)
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        await clock.sleep(1.0)
        in_flight[0] -= 1

    clock.run(dispatch_concurrent(send_one, range(10), 3, None, clock))
    assert sorted(sent) == list(range(10))
    assert peak[0] == 3


def test_concurrency_dispatcher_stops_sending_at_the_deadline():
    clock, sent = FakeClock(), []

    async def send_one(index: int) -> None:
        sent.append(clock.now())
        await clock.sleep(1.0)

    clock.run(dispatch_concurrent(send_one, range(1000), 1, 5.0, clock))
    assert sent == [0.0, 1.0, 2.0, 3.0, 4.0]


def _take(iterator, count):
    return [next(iterator) for _ in range(count)]


# ---- length distributions and workloads ----------------------------------------------------------------


def test_length_distributions():
    rng = random.Random(0)
    assert {LengthDist.parse("128").sample(rng) for _ in range(10)} == {128}
    assert LengthDist.parse("fixed:64").sample(rng) == 64
    uniform = [LengthDist.parse("uniform:10:20").sample(rng) for _ in range(5000)]
    assert min(uniform) == 10 and max(uniform) == 20
    assert statistics.fmean(uniform) == pytest.approx(15.0, rel=0.02)
    lognormal = [LengthDist.parse("lognormal:200:0.5").sample(rng) for _ in range(5000)]
    assert statistics.median(lognormal) == pytest.approx(200, rel=0.05)
    # The mean of a log-normal is median * exp(sigma^2 / 2).
    assert statistics.fmean(lognormal) == pytest.approx(200 * math.exp(0.125), rel=0.05)
    capped = [LengthDist.parse("lognormal:200:2:300").sample(rng) for _ in range(2000)]
    assert max(capped) == 300 and min(capped) >= 1
    for bad in ("0", "uniform:5:2", "lognormal:100", "gamma:1:2", "x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_workload_is_deterministic_per_index():
    workload = Workload(
        LengthDist.parse("uniform:4:40"),
        LengthDist.parse("8"),
        chat=False,
        prompt_kind="token-ids",
        token_id_range=(5, 50),
        seed=1,
    )
    first = workload.request(3)
    assert first.prompt == workload.request(3).prompt
    assert first.prompt != workload.request(4).prompt
    assert len(first.prompt) == first.prompt_tokens and 4 <= first.prompt_tokens <= 40
    assert all(5 <= t < 50 for t in first.prompt) and first.max_tokens == 8
    chat = Workload(LengthDist.parse("10"), LengthDist.parse("5"), chat=True).request(0)
    assert chat.messages[0]["role"] == "user" and len(chat.messages[0]["content"].split()) == 10
    with pytest.raises(ValueError):
        Workload(LengthDist.parse("10"), LengthDist.parse("5"), chat=True, prompt_kind="token-ids")


def test_dataset_rows(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": "hello there", "max_tokens": 3},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"prompt": [1, 2, 3]},
    ]
    path.write_text("\n".join(json.dumps(row) for row in rows) + "\n\n")
    assert len(load_dataset(path)) == 3
    workload = Workload(LengthDist.parse("1"), LengthDist.parse("9"), chat=False, dataset=path)
    assert (workload.request(0).prompt, workload.request(0).max_tokens) == ("hello there", 3)
    assert (workload.request(1).prompt, workload.request(1).max_tokens) == ("hi", 9)
    assert workload.request(2).prompt_tokens == 3
    assert workload.request(3).prompt == "hello there"  # cycles
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError):
        load_dataset(bad)


# ---- the server's metrics ------------------------------------------------------------------------------

BEFORE = """# HELP vllm_neuron:padding_slots_total x
vllm_neuron:padding_real_tokens_total{phase="decode"} 100.0
vllm_neuron:padding_slots_total{phase="decode"} 128.0
vllm_neuron:unexpected_recompiles_total 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0
"""
AFTER = """vllm_neuron:padding_real_tokens_total{phase="decode"} 400.0
vllm_neuron:padding_slots_total{phase="decode"} 528.0
vllm_neuron:padding_real_tokens_total{phase="prefill"} 300.0
vllm_neuron:padding_slots_total{phase="prefill"} 512.0
vllm_neuron:unexpected_recompiles_total 0.0
vllm_neuron:step_seconds_sum{part="forward"} 2.0
vllm_neuron:step_seconds_count{part="forward"} 40.0
vllm:generation_tokens_total{engine="0",model_name="m"} 1.2e3
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 15.0
"""


def test_metric_deltas_padding_efficiency_and_gauges():
    before, after = parse_prometheus(BEFORE), parse_prometheus(AFTER)
    assert before[("vllm_neuron:padding_slots_total", (("phase", "decode"),))] == 128.0
    gauges = GaugeTrack()
    for usage in (0.25, 0.75):
        gauges.add(parse_prometheus(f'vllm:kv_cache_usage_perc{{engine="0"}} {usage}\n'))
    summary = run_summary(before, after, gauges)
    assert summary["plugin_series"]
    assert summary["unexpected_recompiles"] == 0
    # decode (400 - 100) / (528 - 128); prefill new since the start: 300 / 512
    assert summary["padding_efficiency"] == pytest.approx({"decode": 0.75, "prefill": 300 / 512})
    assert summary["step_ms_mean"] == pytest.approx({"forward": 50.0})
    assert summary["generation_tokens"] == 1200.0
    assert summary["gauges"]["vllm:kv_cache_usage_perc"] == {"max": 0.75, "mean": 0.5, "samples": 2}
    # speculative decoding: half the draft tokens accepted, 1.5 of them a draft, and the target's own token
    assert summary["speculative"] == {
        "drafts": 10.0,
        "draft_tokens": 30.0,
        "accepted_tokens": 15.0,
        "acceptance_rate": 0.5,
        "tokens_per_verify_step": 2.5,
    }
    assert run_summary(before, before, gauges)["speculative"] is None  # a server without it


# ---- streamed responses --------------------------------------------------------------------------------


def _sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def _send_with(handler) -> RequestRecord:
    """One request through httpx's in-process transport (a scripted HTTP peer, no network)."""

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            target = Target("http://peer", "m", endpoint=COMPLETIONS)
            return await send(
                client,
                target,
                Workload(LengthDist("fixed", 3), LengthDist("fixed", 2), chat=False).request(0),
            )

    return asyncio.run(go())


def test_stream_parsing_and_error_kinds():
    body = _sse(
        {"choices": [{"text": "a"}]},
        {"choices": [{"text": ""}]},  # carries no text: not an arrival
        {"choices": [{"text": "b"}]},
        {"choices": [], "usage": {"completion_tokens": 3, "prompt_tokens": 5}},
    )
    record = _send_with(lambda request: httpx.Response(200, content=body))
    assert record.ok and len(record.chunk_times) == 2
    assert (record.output_tokens, record.prompt_tokens) == (3, 5)
    assert _send_with(lambda request: httpx.Response(503, json={"error": "busy"})).error == "http_503"
    assert _send_with(lambda r: httpx.Response(200, content=_sse({"error": {"message": "x"}}))).error == (
        "stream_error"
    )
    assert _send_with(lambda r: httpx.Response(200, content=b"data: {oops\n\n")).error == "bad_stream"
    assert _send_with(lambda r: httpx.Response(200, content=_sse())).error == "no_tokens"

    def refuse(request):
        raise httpx.ConnectError("refused")

    assert _send_with(refuse).error == "connect"
    assert chunk_text({"choices": [{"delta": {"content": "x", "reasoning_content": "y"}}]}, chat=True) == "xy"


# ---- CLI, report, Locust file --------------------------------------------------------------------------


def test_cli_levels():
    levels = levels_from(parser().parse_args(["--concurrency", "1,8,32", "--requests", "12"]))
    assert [(lv.concurrency, lv.requests, lv.rate) for lv in levels] == [
        (1, 12, None),
        (8, 12, None),
        (32, 12, None),
    ]
    levels = levels_from(parser().parse_args(["--rate", "0.5,2", "--duration", "60"]))
    assert [(lv.rate, lv.concurrency, lv.requests, lv.duration_s) for lv in levels] == [
        (0.5, 256, None, 60.0),
        (2.0, 256, None, 60.0),
    ]
    levels = levels_from(parser().parse_args(["--concurrency", "1,8", "--requests", "4,16"]))
    assert [(lv.concurrency, lv.requests) for lv in levels] == [(1, 4), (8, 16)]
    assert levels_from(parser().parse_args([]))[0].requests == 100
    with pytest.raises(SystemExit):
        levels_from(parser().parse_args(["--concurrency", "1,8,32", "--requests", "4,16"]))
    with pytest.raises(SystemExit):
        parser().parse_args(["--concurrency", "0"])


def test_cli_price():
    def price(*argv: str) -> dict | None:
        return price_from(parser().parse_args(list(argv)))

    assert price() is None
    assert price("--price-per-hour", "12.5") == {"dollars_per_hour": 12.5}
    whole = price("--instance", "trn2.48xlarge")
    assert whole["dollars_per_hour"] == 35.7608 and (whole["chips"], whole["instance_chips"]) == (16, 16)
    assert whole["basis"] == "Capacity Block" and "capacityblocks" in whole["source"]
    # TP=4 on 1 of 16 chips pays 1/16 of the instance; an own price replaces the documented one.
    assert price("--instance", "trn2.48xlarge", "--chips", "1")["dollars_per_hour"] == pytest.approx(2.23505)
    own = price("--instance", "trn2.48xlarge", "--chips", "4", "--price-per-hour", "16")
    assert own["dollars_per_hour"] == pytest.approx(4.0) and own["source"] is None
    for bad in (["--price-per-hour", "-1"], ["--price-per-hour", "0"], ["--price-per-hour", "nan"]):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)
    with pytest.raises(SystemExit):
        parser().parse_args(["--instance", "m5.large"])
    with pytest.raises(SystemExit):
        parser().parse_args(["--instance", "trn2.48xlarge", "--chips", "0"])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--instance", "p5.48xlarge", "--chips", "9"], "--chips: chips used must be 1 to 8"),
        (["--chips", "2"], "--chips needs --instance"),
    ],
)
def test_cli_refuses_a_share_it_cannot_charge(argv, message, capsys):
    # Refused before anything is sent: no server behind the default URL is needed.
    with pytest.raises(SystemExit) as refused:
        main(argv)
    assert refused.value.code == 2 and message in capsys.readouterr().err


def test_report_with_a_price(tmp_path):
    results = []
    for concurrency, prompt_tokens in ((1, 5), (4, 0)):
        records = [
            RequestRecord(
                start=0.0, end=1.0, chunk_times=[0.5, 1.0], output_tokens=4, prompt_tokens=prompt_tokens
            )
        ]
        summary = level_summary(records, 1.0, dollars_per_hour=36.0)
        results.append(LevelResult(Level(concurrency), records, summary, server=None))
    # $0.01 for the 1 s level, over 4 output tokens ($2,500 per million) and 5 prompt tokens ($2,000);
    # the second level has no prompt tokens: no figure, never a made-up one.
    header, _, first, second = report.table(results).splitlines()[:4]
    assert "$/M out" in header and "$/M in" in header
    assert "2500.00" in first and "2000.00" in first
    assert second.split()[7:9] == ["2500.00", "-"]  # after "concurrency 4", "1 / 0", req/s, tok/s
    line = report.price_line({"dollars_per_hour": 36.0})
    assert line.startswith("cost at $36.0000/h")
    doc = report.document(results, {"price": {"dollars_per_hour": 36.0}}, {"ours": False})
    report.write_json(doc, tmp_path / "run.json")
    levels = json.loads((tmp_path / "run.json").read_text())["levels"]
    assert levels[0]["dollars_per_million_prompt_tokens"] == pytest.approx(2000.0)
    assert levels[1]["dollars_per_million_prompt_tokens"] is None
    pytest.importorskip("matplotlib")
    written = report.write_plots(results, tmp_path / "plots")
    assert [p.name for p in written] == ["latency_cdf.png", "throughput.png"]


def test_report_table_json_and_plots(tmp_path):
    results = []
    for concurrency in (1, 4):
        records = [
            RequestRecord(start=0.0, end=1.0, chunk_times=[0.2, 0.5, 1.0], output_tokens=3),
            RequestRecord(start=0.1, end=0.2, error="http_429"),
        ]
        summary = level_summary(records, measured_window(records))
        results.append(LevelResult(Level(concurrency), records, summary, server=None))
    text = report.table(results)
    assert "concurrency 4" in text and "http_429" in text and "$/M" not in text  # no price, no cost
    doc = report.document(results, {"seed": 0}, {"ours": False})
    report.write_json(doc, tmp_path / "run.json")
    loaded = json.loads((tmp_path / "run.json").read_text())
    assert loaded["levels"][1]["concurrency"] == 4 and loaded["levels"][0]["errors"] == {"http_429": 1}
    pytest.importorskip("matplotlib")
    written = report.write_plots(results, tmp_path / "plots")
    assert [p.name for p in written] == ["latency_cdf.png", "throughput.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written)


def test_locustfile_compiles():
    py_compile.compile(str(ROOT / "loadtest" / "locustfile.py"), doraise=True)
