"""Every warm-up graph of the default model through TorchNeuron's lowering route (`--compile-backend
stablehlo`): SmolLM2-135M-Instruct in bfloat16 with the settings `make serve` uses, in an offline engine.

    .venv/bin/python benchmarks/lowering.py [--dtype bfloat16] [--dump-graphs DIR] [--json-out F]

Prints, per graph: the call (phase, bucket), lowering seconds, StableHLO op count, largest intermediate and
whether its KV cache writes are each one aliased scatter of the call's rows (vllm_neuron.compiler.hlo_text);
then the totals (graphs, warm-up and lowering seconds, the process's peak resident memory) and the op
histograms of one prefill and one decode graph. Too slow for CI (several minutes on 2 cores); asserts nothing.
"""

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dump-graphs", type=Path, help="write each graph's FX graph and StableHLO here")
    parser.add_argument("--json-out", type=Path)
    args = parser.parse_args()
    os.environ.update(
        VLLM_NEURON_DEVICE="cpu",
        VLLM_NEURON_COMPILE_BACKEND="stablehlo",
        VLLM_NEURON_READINESS="full",  # every graph lowered in warm-up, counted there
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # the engine core in this process: its peak memory is ours
        VLLM_HOST_IP="127.0.0.1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
    )
    if args.dump_graphs:
        os.environ["VLLM_NEURON_DUMP_GRAPHS"] = str(args.dump_graphs)
    from vllm import LLM

    from server.default_model import ensure_default_model
    from server.serve_args import DEFAULT_MODEL_MAX_LEN
    from vllm_neuron.compiler import hlo_text

    model = ensure_default_model()
    start = time.perf_counter()
    llm = LLM(model=str(model), dtype=args.dtype, max_model_len=DEFAULT_MODEL_MAX_LEN, seed=0)
    startup = time.perf_counter() - start
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    graphs = runner.recorder.lowering.graphs
    rows = []
    for graph in graphs:
        writes = hlo_text.cache_writes(graph.stablehlo)
        problems = [problem for write in writes for problem in write.problems]
        rows.append({**graph.summary(), "cache_writes_in_place": not problems, "problems": problems[:3]})
        largest = graph.largest_tensor
        print(
            f"{graph.label}: {graph.seconds:.2f} s, {graph.op_count} ops, largest {largest[1]} "
            f"{list(largest[0])}, {len(writes)} cache writes {'in place' if not problems else problems[:2]}",
            flush=True,
        )
    peak_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    prefill = next(graph for graph in graphs if graph.label.startswith("prefill"))
    decode = next(
        graph for graph in graphs if graph.label.startswith("decode") and "with prefill" not in graph.label
    )
    result = {
        "model": str(model),
        "dtype": args.dtype,
        "graphs": len(graphs),
        "lowered_in_place": sum(row["cache_writes_in_place"] for row in rows),
        "startup_seconds": round(startup, 1),
        "lowering_seconds": round(sum(graph.seconds for graph in graphs), 1),
        "peak_rss_gib": round(peak_gib, 2),
        "histograms": {prefill.label: prefill.op_histogram, decode.label: decode.op_histogram},
        "per_graph": rows,
    }
    print(json.dumps({k: v for k, v in result.items() if k != "per_graph"}, indent=1))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1))
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
