"""Per-graph XLA cost of two `vllm-neuron check --json` reports side by side (before and after a change).

    vllm-neuron check [MODEL] [serve options] --json > before.json   # from a tree of the old commit
    vllm-neuron check [MODEL] [serve options] --json > after.json
    .venv/bin/python benchmarks/graph_costs.py before.json after.json [--label MODEL] [--full]

Each graph of the bucket plan (matched by its call label) gets one row: XLA's bytes accessed, its ratio to
the graph's floor (`bytes_over_minimum`: every argument but the caches read once, the KV its rows attend to
read once, new KV and outputs written), flops, the trn2 estimate and the floor's time on trn2 (minimum_ms).
Decode graphs come first, in full; the largest decode batch x largest decode context graph is marked in
bold (issue 38's target: its bytes within 1.3x the floor). Prefill, mixed and verify graphs follow, summed
up as min / median / max of each ratio (all their rows with --full). Prints markdown; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

DECODE = re.compile(r"^decode of \d+ requests: batch (\d+) x context (\d+)$")
Graph = dict[str, object]


def graphs(report: dict) -> dict[str, Graph]:
    """The report's lowered graphs by call label (graphs without XLA figures are left out)."""
    lowering = report.get("lowering") or {}
    return {g["call"]: g for g in lowering.get("graphs", []) if g.get("bytes_accessed") is not None}


def decode_shape(label: str) -> tuple[int, int] | None:
    """(batch, context) of a plain decode graph's label; None for prefill, mixed and verify graphs."""
    match = DECODE.match(label)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _int(value: object) -> str:
    return "-" if value is None else f"{int(value):,}"


def _float(value: object, digits: int = 2) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def _ratio(after: object, before: object) -> float | None:
    if after is None or not before:
        return None
    return float(after) / float(before)


HEADER = (
    "| graph | bytes accessed before | after | after / before | x floor before | after | flops before "
    "| after | trn2 est. ms before | after | floor ms |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def row(label: str, before: Graph | None, after: Graph | None, bold: bool = False) -> str:
    b, a = before or {}, after or {}
    name = f"**{label}**" if bold else label
    cells = [
        name,
        _int(b.get("bytes_accessed")),
        _int(a.get("bytes_accessed")),
        _float(_ratio(a.get("bytes_accessed"), b.get("bytes_accessed")), 3),
        _float(b.get("bytes_over_minimum")),
        _float(a.get("bytes_over_minimum")),
        _int(b.get("flops")),
        _int(a.get("flops")),
        _float(b.get("trn2_estimate_ms"), 3),
        _float(a.get("trn2_estimate_ms"), 3),
        _float(a.get("minimum_ms", b.get("minimum_ms")), 3),
    ]
    if bold:
        cells = [cells[0], *(f"**{c}**" for c in cells[1:])]
    return "| " + " | ".join(cells) + " |"


def summary(labels: list[str], before: dict[str, Graph], after: dict[str, Graph]) -> str:
    """min / median / max over the graphs named of each figure's before, after and after / before."""
    lines = ["| figure | min | median | max |", "|---|---|---|---|"]
    figures = {
        "x floor before": [before[k].get("bytes_over_minimum") for k in labels if k in before],
        "x floor after": [after[k].get("bytes_over_minimum") for k in labels if k in after],
        "bytes after / before": [
            _ratio(after[k]["bytes_accessed"], before[k]["bytes_accessed"])
            for k in labels
            if k in before and k in after
        ],
        "flops after / before": [
            _ratio(after[k]["flops"], before[k]["flops"]) for k in labels if k in before and k in after
        ],
        "trn2 est. after / before": [
            _ratio(after[k]["trn2_estimate_ms"], before[k]["trn2_estimate_ms"])
            for k in labels
            if k in before and k in after
        ],
    }
    for name, values in figures.items():
        found = [float(v) for v in values if v is not None]
        if found:
            lines.append(f"| {name} | {min(found):.3f} | {statistics.median(found):.3f} | {max(found):.3f} |")
    return "\n".join(lines)


def table(before_report: dict, after_report: dict, label: str | None = None, full: bool = False) -> str:
    before, after = graphs(before_report), graphs(after_report)
    labels = list(dict.fromkeys([*after, *before]))
    decode = sorted((k for k in labels if decode_shape(k)), key=decode_shape)
    others = [k for k in labels if not decode_shape(k)]
    target = max(decode, key=decode_shape) if decode else None
    plan = after_report.get("plan") or {}
    title = label or after_report.get("model", "?")
    lines = [
        f"### {title} ({after_report.get('dtype', '?')}, TP {plan.get('tensor_parallel_size', '?')}, "
        f"max_model_len {plan.get('max_model_len', '?')}): {len(labels)} graphs",
        "",
        f"Decode graphs ({len(decode)}); in bold the largest batch x largest context:",
        "",
        HEADER,
        *(row(k, before.get(k), after.get(k), bold=k == target) for k in decode),
    ]
    if others:
        lines += ["", f"Prefill, mixed and verify graphs ({len(others)}):", ""]
        lines += [HEADER, *(row(k, before.get(k), after.get(k)) for k in others)] if full else []
        lines += ["", summary(others, before, after)] if full else [summary(others, before, after)]
    missing = sorted(set(before) ^ set(after))
    if missing:
        lines += ["", "In one report only: " + "; ".join(missing)]
    return "\n".join(lines)


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("before", type=Path, help="`vllm-neuron check --json` output of the old commit")
    parser.add_argument("after", type=Path, help="the same check's output at the new commit")
    parser.add_argument("--label", help="the table's title (default: the report's model)")
    parser.add_argument("--full", action="store_true", help="every prefill/mixed/verify graph's row too")
    args = parser.parse_args()
    before, after = (json.loads(path.read_text()) for path in (args.before, args.after))
    print(table(before, after, args.label, args.full))


if __name__ == "__main__":
    main()
