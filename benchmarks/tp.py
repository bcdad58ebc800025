"""Tensor parallelism in CPU mode: TP=1 against TP>1 on SmolLM2-135M, offline engine, greedy decoding.

    .venv/bin/python benchmarks/tp.py [--tp 1,3] [--prompts 8] [--max-tokens 32]

SmolLM2-135M has 9 attention heads and 3 KV heads, so TP=2 is refused at start-up (2 does not divide 9);
the default compares TP=1 with TP=3 (one KV head per rank).

Prints output tokens/s and seconds per engine step for each TP size, and for TP>1 the communication of one
decode step: each of the model's collectives (two all-reduces of [batch, hidden] per layer, one all-gather
of the [batch, vocab / TP] logits) timed over the real gloo process group inside the worker processes,
times their count per step, as a share of the step. On a 2-core host the two ranks share the cores with each
other and the engine, so this measures the overhead of TP (processes, collectives), not a speed-up: on
Trainium each rank has its own NeuronCore. Asserts nothing.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENGINE = dict(
    dtype="float32",
    max_model_len=512,
    max_num_seqs=8,
    max_num_batched_tokens=128,
    seed=0,
    additional_config={
        "prefill_buckets": [64, 128],
        "decode_batch_buckets": [1, 2, 4, 8],
        "context_buckets": [256, 512],
    },
)


def time_collectives(worker, batches: tuple[int, ...] = (1, 8), repeats: int = 50) -> dict:
    """In each worker (collective_rpc): seconds per collective of a decode step's shapes, and per step."""
    import torch
    from vllm.distributed import get_tp_group

    group = get_tp_group()
    config = worker.model_config
    hidden, vocab = config.get_hidden_size(), config.get_vocab_size()
    layers = config.get_num_layers(worker.parallel_config)
    result = {}
    for batch in batches:
        x = torch.randn(batch, hidden)
        logits = torch.randn(batch, vocab // group.world_size)
        group.all_reduce(x)  # first use sets up buffers
        group.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            group.all_reduce(x)
        all_reduce = (time.perf_counter() - start) / repeats
        group.barrier()
        start = time.perf_counter()
        for _ in range(repeats):
            group.all_gather(logits, dim=-1)
        all_gather = (time.perf_counter() - start) / repeats
        result[batch] = {
            "all_reduce_s": all_reduce,
            "all_gather_s": all_gather,
            "per_step_s": 2 * layers * all_reduce + all_gather,
        }
    return {"rank": group.rank_in_group, "layers": layers, "batches": result}


def child(tp: int, prompts: int, max_tokens: int) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from server.default_model import ensure_default_model

    start = time.perf_counter()
    llm = LLM(model=str(ensure_default_model()), tensor_parallel_size=tp, **ENGINE)
    ready = time.perf_counter() - start
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for index in range(prompts):
        prompt = [(index * 37 + k * 11) % 4000 + 100 for k in range(32)]
        engine.add_request(f"r{index}", TokensPrompt(prompt_token_ids=prompt), params)
    steps, tokens = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                tokens += len(output.outputs[0].token_ids)
        steps += 1
    seconds = time.perf_counter() - start
    comm = llm.collective_rpc(time_collectives) if tp > 1 else None
    result = {
        "tp": tp,
        "startup_s": ready,
        "output_tokens": tokens,
        "seconds": seconds,
        "steps": steps,
        "comm": comm,
    }
    print("RESULT " + json.dumps(result), flush=True)


def run(tp: int, prompts: int, max_tokens: int) -> dict:
    env = dict(os.environ, VLLM_NEURON_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, __file__, "--child", str(tp), "--prompts", str(prompts)]
    done = subprocess.run(
        [*command, "--max-tokens", str(max_tokens)], env=env, capture_output=True, text=True, cwd=ROOT
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"TP={tp} failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    from vllm_neuron import host_cpu

    print(host_cpu.summary(), flush=True)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tp", default="1,3", help="comma-separated TP sizes")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.prompts, args.max_tokens)
        return
    print(f"CPU mode, {os.cpu_count()} cores: this measures TP overhead, not a speed-up.")
    print(f"{args.prompts} prompts of 32 tokens, {args.max_tokens} output tokens each, greedy")
    for tp in [int(size) for size in args.tp.split(",")]:
        result = run(tp, args.prompts, args.max_tokens)
        rate = result["output_tokens"] / result["seconds"]
        step_ms = 1000 * result["seconds"] / result["steps"]
        print(
            f"TP={tp}: {rate:.1f} output tokens/s, {result['steps']} steps, {step_ms:.1f} ms per step "
            f"(start-up with warm-up {result['startup_s']:.0f} s)"
        )
        for rank in result["comm"] or []:
            for batch, figures in rank["batches"].items():
                print(
                    f"  rank {rank['rank']}, decode batch {batch}: all-reduce "
                    f"{1e6 * figures['all_reduce_s']:.0f} us, logits all-gather "
                    f"{1e6 * figures['all_gather_s']:.0f} us -> {1000 * figures['per_step_s']:.2f} ms "
                    f"of communication per step ({2 * rank['layers']} all-reduces + 1 all-gather), "
                    f"{100 * figures['per_step_s'] / (step_ms / 1000):.0f}% of a {step_ms:.1f} ms step"
                )


if __name__ == "__main__":
    main()
