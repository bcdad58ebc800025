"""The markdown tables of benchmarks/compare.py's result: throughput side by side and its ratios, latency
percentiles, the machine's roofline, and (a)'s time per step part."""

CONCURRENCY = (1, 8, 32)


def _p(summary: dict, key: str) -> str:
    values = summary[key]
    return (
        " / ".join(
            f"{values[f'p{q}']:.0f}" if values[f"p{q}"] >= 10 else f"{values[f'p{q}']:.1f}"
            for q in (50, 90, 99)
        )
        if values["count"]
        else "-"
    )


def markdown(result: dict) -> str:
    a = {lv["concurrency"]: lv for lv in result["ours"]["levels"]}
    b = {lv["concurrency"]: lv for lv in result["vllm_cpu"]["levels"]}
    before = result.get("ours_before")
    a0 = {lv["concurrency"]: lv for lv in before["levels"]} if before else None
    rev = before["source"]["commit"] if before else ""
    c = result.get("hf")
    c_at = {1: c["sequential"], 8: c["batch8"], 32: c["batch32"]} if c else None
    tok = "output_tokens_per_s"
    lines = ["| system | c=1 | c=8 | c=32 |", "|---|---|---|---|"]
    systems = {"(a) vllm-torchneuron, CPU mode": a}
    if a0 is not None:
        systems = {f"(a) vllm-torchneuron, CPU mode, now ({result['ours']['source']['commit']})": a}
        systems[f"(a) vllm-torchneuron, CPU mode, before ({rev})"] = a0
    systems["(b) vLLM CPU platform"] = b
    for name, levels in systems.items():
        lines.append(f"| {name} | " + " | ".join(f"{levels[k][tok]:.1f}" for k in CONCURRENCY) + " |")
    if c is not None:
        lines.append(f"| (c) HF generate, sequential (batch 1) | {c['sequential'][tok]:.1f} | | |")
        lines.append(
            "| (c) HF generate, static batch of c | "
            + " | ".join(f"{c_at[k][tok]:.1f}" for k in CONCURRENCY)
            + " |"
        )
    lines += ["", "| ratio | c=1 | c=8 | c=32 |", "|---|---|---|---|"]
    rows = {"(a) / (b)": [a[k][tok] / b[k][tok] for k in CONCURRENCY]}
    if a0 is not None:
        rows["(a) before / (b)"] = [a0[k][tok] / b[k][tok] for k in CONCURRENCY]
        rows["(a) now / (a) before"] = [a[k][tok] / a0[k][tok] for k in CONCURRENCY]
    if c is not None:
        rows |= {
            "(a) / (c) sequential": [a[k][tok] / c["sequential"][tok] for k in CONCURRENCY],
            "(a) / (c) static batch of c": [a[k][tok] / c_at[k][tok] for k in CONCURRENCY],
            "(b) / (c) sequential": [b[k][tok] / c["sequential"][tok] for k in CONCURRENCY],
            "(b) / (c) static batch of c": [b[k][tok] / c_at[k][tok] for k in CONCURRENCY],
        }
    lines += [f"| {name} | " + " | ".join(f"{v:.2f}" for v in values) + " |" for name, values in rows.items()]
    lines += ["", "| system | c | requests | TTFT p50 / p90 / p99 ms | ITL p50 / p90 / p99 ms | E2E p50 ms |"]
    lines.append("|---|---|---|---|---|---|")
    latency = {
        "(a)": a,
        **({f"(a) before ({rev})": a0} if a0 else {}),
        "(b)": b,
        **({"(c)": c_at} if c else {}),
    }
    for name, levels in latency.items():
        for k in CONCURRENCY:
            s = levels[k]
            lines.append(
                f"| {name} | {k} | {s['completed']} | {_p(s, 'ttft_ms')} | {_p(s, 'itl_ms')} | "
                f"{s['e2e_ms']['p50']:.0f} |"
            )
    hw = result["roofline"]
    weights = c["weight_bytes"] if c else 0
    lines += ["", "| roofline | start | end |", "|---|---|---|"]
    for key, label in (
        ("copy_gb_s", "tensor copy GB/s (read + write)"),
        ("read_gb_s", "tensor sum GB/s (read)"),
        ("bf16_matmul_gflop_s", "bf16 matmul 2048^3 GFLOP/s"),
    ):
        lines.append(f"| {label} | {hw['start'][key]:.1f} | {hw['end'][key]:.1f} |")
    if c is None:
        return "\n".join([*lines, *_steps(a, a0, rev)])
    bandwidth = hw["start"]["copy_gb_s"] * 1e9
    steps = bandwidth / weights
    flops_per_token = 2 * c["parameters"]
    compute_tok_s = hw["start"]["bf16_matmul_gflop_s"] * 1e9 / flops_per_token
    lines += [
        "",
        f"Weights: {c['parameters']:,} parameters, {weights / 1e6:.1f} MB in bf16. Decode roofline at the "
        f"start's copy bandwidth ({bandwidth / 1e9:.1f} GB/s): {steps:.0f} steps/s, so at most "
        + ", ".join(f"{k * steps:.0f} tok/s at batch {k}" for k in CONCURRENCY)
        + f" (weights only); compute bound at {hw['start']['bf16_matmul_gflop_s']:.0f} GFLOP/s and "
        f"{flops_per_token / 1e9:.2f} GFLOP per token: {compute_tok_s:.0f} tok/s.",
    ]
    lines += _steps(a, a0, rev)[:-1]
    lines.append(
        "| HF model's linear layers alone, batch of c rows | "
        + " | ".join(f"{c['linears_ms'][str(k)]:.1f}" for k in CONCURRENCY)
        + " |"
    )
    if "attention_ms" in result:
        lines.append(
            "| the plugin's paged attention alone, c rows x 512 context, 30 layers | "
            + " | ".join(f"{result['attention_ms'][str(k)]:.1f}" for k in CONCURRENCY)
            + " |"
        )
    lines.append(_steps(a, a0, rev)[-1])
    return "\n".join(lines)


def _steps(a: dict, a0: dict | None, rev: str) -> list[str]:
    """(a)'s mean time per step part (and before's, with --before); its padding efficiency last."""
    lines = ["", "| (a) per step, mean ms | c=1 | c=8 | c=32 |", "|---|---|---|---|"]
    for suffix, levels in (("", a), *(((f", before ({rev})", a0),) if a0 else ())):
        parts = sorted({p for k in CONCURRENCY for p in (levels[k]["server"] or {}).get("step_ms_mean", {})})
        for part in parts:
            lines.append(
                f"| {part}{suffix} | "
                + " | ".join(
                    f"{(levels[k]['server'] or {}).get('step_ms_mean', {}).get(part, float('nan')):.1f}"
                    for k in CONCURRENCY
                )
                + " |"
            )
    eff = [a[k]["server"]["padding_efficiency"] if a[k]["server"] else {} for k in CONCURRENCY]
    lines.append(
        "| padding efficiency prefill / decode | "
        + " | ".join(
            f"{e.get('prefill', float('nan')):.2f} / {e.get('decode', float('nan')):.2f}" for e in eff
        )
        + " |"
    )
    return lines


def ours_table(*docs: dict) -> str:
    lines = ["| (a) output tok/s | c=1 | c=8 | c=32 |", "|---|---|---|---|"]
    for doc in docs:
        levels = {lv["concurrency"]: lv for lv in doc["levels"]}
        lines.append(
            f"| vllm-torchneuron, CPU mode, {doc['source']['commit']} | "
            + " | ".join(f"{levels[k]['output_tokens_per_s']:.1f}" for k in CONCURRENCY)
            + " |"
        )
    return "\n".join(lines)
