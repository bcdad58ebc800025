"""A run's results as a terminal table, a JSON document and PNG plots (latency CDFs, throughput and, given a
price, $ per million tokens vs concurrency or rate)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from loadtest.runner import LevelResult
from loadtest.stats import inter_token_latencies, percentile


def _ms(summary: dict, key: str) -> str:
    values = summary[key]
    if not values["count"]:
        return "-"
    return " / ".join(_num(values[f"p{q}"]) for q in (50, 90, 99))


def _num(value: float | None, digits: int = 0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}" if digits or abs(value) >= 10 else f"{value:.1f}"


def _dollars(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:.2f}" if value >= 1 else f"{value:.3g}"


# The summary's cost figures (stats.run_cost), as the table's and the plot's columns show them.
COST_KEYS = ("dollars_per_million_output_tokens", "dollars_per_million_prompt_tokens")


def _priced(results: Sequence[LevelResult]) -> bool:
    return any(COST_KEYS[0] in r.summary for r in results)


def table(results: Sequence[LevelResult]) -> str:
    priced = _priced(results)
    header = (
        "level",
        "ok / failed",
        "req/s",
        "out tok/s",
        *(("$/M out", "$/M in") if priced else ()),
        "TTFT p50/p90/p99 ms",
        "ITL p50/p90/p99 ms",
        "E2E p50/p90/p99 ms",
    )
    rows = [header]
    for result in results:
        s = result.summary
        rows.append(
            (
                result.level.label,
                f"{s['completed']} / {s['failed']}",
                _num(s["requests_per_s"], 2),
                _num(s["output_tokens_per_s"], 1),
                *(_dollars(s.get(key, math.nan)) for key in (COST_KEYS if priced else ())),
                _ms(s, "ttft_ms"),
                _ms(s, "itl_ms"),
                _ms(s, "e2e_ms"),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    for result in results:
        if result.summary["errors"]:
            lines.append(f"{result.level.label}: errors {result.summary['errors']}")
        lines.extend(_server_lines(result))
    return "\n".join(lines)


def price_line(price: dict) -> str:
    """How the hourly charge behind the $/M columns was formed."""
    line = f"cost at ${price['dollars_per_hour']:.4f}/h"
    if "instance" in price:
        line += (
            f": {price['chips']} of {price['instance']}'s {price['instance_chips']} chips at"
            f" ${price['instance_dollars_per_hour']:.4f}/h ({price['basis']}"
            + (f", {price['source']}, read {price['read']}" if price["source"] else "")
            + ")"
        )
    return line + "; $/M out and $/M in each divide the whole cost of a level"


def _server_lines(result: LevelResult) -> list[str]:
    server = result.server
    if not server or not server.get("plugin_series"):
        usage = ((server or {}).get("gauges") or {}).get("vllm:kv_cache_usage_perc")
        return [f"{result.level.label}: KV cache usage peak {usage['max']:.1%}"] if usage else []
    parts = [f"recompiles +{_num(server['unexpected_recompiles'])}"]
    efficiency = server["padding_efficiency"]
    if efficiency:
        parts.append(
            "padding efficiency " + ", ".join(f"{phase} {value:.3f}" for phase, value in efficiency.items())
        )
    gauges = server["gauges"]
    if "vllm_neuron:kv_blocks_used" in gauges and "vllm_neuron:kv_blocks_total" in gauges:
        used, all_blocks = gauges["vllm_neuron:kv_blocks_used"], gauges["vllm_neuron:kv_blocks_total"]
        parts.append(f"KV blocks peak {used['max']:.0f} / {all_blocks['max']:.0f}")
    if "vllm:kv_cache_usage_perc" in gauges:
        parts.append(f"KV usage peak {gauges['vllm:kv_cache_usage_perc']['max']:.1%}")
    speculative = server.get("speculative")
    if speculative and speculative["acceptance_rate"] is not None:
        parts.append(
            f"speculative: {speculative['acceptance_rate']:.1%} of {_num(speculative['draft_tokens'])} draft "
            f"tokens accepted, {speculative['tokens_per_verify_step']:.2f} tokens a verify step"
        )
    if server["step_ms_mean"]:
        parts.append(
            "step ms mean " + ", ".join(f"{part} {ms:.1f}" for part, ms in server["step_ms_mean"].items())
        )
    return [f"{result.level.label}: " + "; ".join(parts)]


def document(results: Sequence[LevelResult], config: dict, target: dict) -> dict:
    levels = []
    for result in results:
        entry = {
            "concurrency": result.level.concurrency,
            "rate": result.level.rate,
            "warmup_requests": result.level.warmup,
            **result.summary,
            "server": result.server,
        }
        if result.level.rate:
            entry["send_late_ms"] = {"p50": 1e3 * percentile(result.late_s, 50)}
            entry["send_late_ms"]["p99"] = 1e3 * percentile(result.late_s, 99)
        levels.append(entry)
    return {"config": config, "target": target, "levels": levels}


def write_json(doc: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # NaN is not JSON: figures with no samples become null.
    path.write_text(json.dumps(_no_nan(doc), indent=2) + "\n")


def _no_nan(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_no_nan(v) for v in value]
    return value


def write_plots(results: Sequence[LevelResult], directory: Path) -> list[Path]:
    """latency_cdf.png (TTFT, ITL, end-to-end; one line per level) and, for several levels,
    throughput.png (output tokens/s and requests/s against concurrency or rate; beside it, given a price,
    $ per million output and input tokens)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot-dir needs matplotlib: pip install 'vllm-torchneuron[loadtest]' (or matplotlib)"
        ) from None
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for result in results:
        ok = [r for r in result.records if r.ok]
        series = (
            [1e3 * r.ttft for r in ok if r.ttft is not None],
            [1e3 * gap for r in ok for gap in inter_token_latencies(r.chunk_times)],
            [1e3 * r.latency for r in ok],
        )
        for axis, values in zip(axes, series, strict=True):
            if values:
                ordered = sorted(values)
                shares = [(i + 1) / len(ordered) for i in range(len(ordered))]
                axis.step(ordered, shares, where="post", label=result.level.label)
    titles = ("time to first token", "inter-token latency (gaps)", "end-to-end latency")
    for axis, title in zip(axes, titles, strict=True):
        axis.set(title=title, xlabel="ms", ylabel="cumulative share")
        axis.set_xscale("log")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    figure.tight_layout()
    written.append(directory / "latency_cdf.png")
    figure.savefig(written[-1], dpi=100)
    plt.close(figure)

    if len(results) > 1:
        by_rate = all(r.level.rate for r in results)
        xs = [r.level.rate if by_rate else r.level.concurrency for r in results]
        priced = _priced(results)
        panels = 2 if priced else 1
        figure, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 4.5), squeeze=False)
        axis = axes[0][0]
        axis.plot(xs, [r.summary["output_tokens_per_s"] for r in results], "o-", label="output tokens/s")
        axis.set_ylabel("output tokens/s")
        right = axis.twinx()
        right.plot(xs, [r.summary["requests_per_s"] for r in results], "s--", color="tab:orange")
        right.set_ylabel("requests/s", color="tab:orange")
        axis.set_title("throughput")
        if priced:
            cost = axes[0][1]
            for key, label in zip(COST_KEYS, ("output", "input"), strict=True):
                cost.plot(xs, [r.summary[key] for r in results], "o-", label=f"$ per million {label} tokens")
            cost.set(title="cost (each divides the whole cost of a level)", ylabel="$ per million tokens")
            cost.set_yscale("log")
            cost.legend(fontsize="small")
        for each in axes[0]:
            each.set_xlabel("request rate (req/s)" if by_rate else "concurrency")
            if not by_rate:
                each.set_xscale("log", base=2)
            each.grid(True, alpha=0.3)
        figure.tight_layout()
        written.append(directory / "throughput.png")
        figure.savefig(written[-1], dpi=100)
        plt.close(figure)
    return written
