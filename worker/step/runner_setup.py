"""The model runner's set-up and the jobs around its step: loading the model, the KV cache, readiness
(warm-up and background compiles, worker/compiles/readiness.py), sleep mode (worker/kv/sleep_mode.py),
speculative decoding's drafts (worker/spec_decode/) and shutdown. NeuronModelRunner
(worker/step/model_runner.py) is the step with these."""

import torch
from vllm.logger import init_logger
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import DraftTokenIds

from vllm_neuron import device as neuron_device
from vllm_neuron import metrics
from vllm_neuron.buckets import GraphKey
from vllm_neuron.graph_plan import GraphPlan
from worker.compiles import warmup
from worker.compiles.readiness import lowered_graphs
from worker.spec_decode import eagle3, speculation
from worker.step import sampling_rows
from worker.step.call_inputs import Chunk
from worker.step.forward import CompiledModel

logger = init_logger("vllm.vllm_neuron.model_runner")


class RunnerSetup:
    """NeuronModelRunner's methods besides the step: its attributes are set in its __init__."""

    @property
    def host_sampler_only(self) -> bool:
        """Every step takes vLLM's host sampler (VLLM_NEURON_SAMPLER=host, or logits processors)."""
        return self.batch.host_only

    @property
    def model(self) -> torch.nn.Module | None:
        return self.compiled.model if self.compiled is not None else None

    @property
    def recorder(self):
        return self.compiled.recorder if self.compiled is not None else None

    # ---- set-up -------------------------------------------------------------------------------------

    def load_model(self) -> None:
        self.compiled = CompiledModel(
            self.vllm_config,
            self.neuron_config.compile_backend,
            self.buckets.num_graphs,
            self.readiness.compile_workers,
            self.tp_rank,
            self.device,
            self.lora,
        )
        self.planner.head = self.compiled.hidden_slots

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return self.kv_cache.spec()

    def initialize_kv_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self._allocate_kv_cache(kv_cache_config)
        metrics.KV_BLOCKS_TOTAL.set(kv_cache_config.num_blocks - 1)
        logger.info(
            "KV cache: %d blocks of %d tokens in %d layers",
            kv_cache_config.num_blocks,
            self.block_size,
            len(self.kv_cache.layers),
        )

    def _allocate_kv_cache(self, config: KVCacheConfig) -> None:
        self.kv_cache.allocate(config, self.compiled.recorder.zeros)
        self.compiled.attention_layers = self.kv_cache.layers

    def warm_up(self) -> float:
        """Compile a KV connector's block copies, then the graphs serving needs
        (worker/compiles/readiness.py); returns the seconds until serving may start."""
        compiled = self.compiled
        plan = GraphPlan(
            self.buckets, compiled.draft is not None, self.kv_transfer.copy_buckets, compiled.head is not None
        )
        seconds = self.kv_transfer.warm_up() + self.readiness.warm_up(
            self.compiled.recorder,
            self._warm_up_step,
            self._compile_in_background,
            max_model_len=self.model_config.max_model_len,
            block_size=self.block_size,
            one_rank=self.vllm_config.parallel_config.tensor_parallel_size == 1,
            plan=plan,
        )
        if self.lora is not None:
            self.lora.warm_up()
        self._log_ready()
        return seconds

    def _warm_up_step(self, item: warmup.WarmupStep) -> None:
        if self.execute_model(item.step) is None:
            self.sample_tokens(None)
        self.execute_model(warmup.finish_step(item.request_ids))
        self._compile_propose((item.phase, *item.shape))
        neuron_device.synchronize()

    def _run_propose(self, call, inputs: "eagle3.ProposeInputs") -> torch.Tensor:
        """An EAGLE3 head's propose call while serving, counted with the step's calls."""
        if self.step_metrics.records_traffic:
            self.stats.record_propose(call)
        return self.compiled.run_propose(call, inputs)

    def _compile_propose(self, graph: GraphKey) -> None:
        """An EAGLE3 head's propose graph of a decode shape, run on synthetic rows (null blocks) whose
        passes reach the shape's context."""
        if self.compiled.head is None or graph[0] != "decode":
            return
        call, _, rows = warmup.synthetic_call(
            graph,
            self.buckets,
            max_model_len=self.model_config.max_model_len,
            blocks_per_request=self.batch.block_table.shape[1],
        )
        passes = self.compiled.hidden_slots.entries - 1
        start = max(1, min(call.decode_context, self.model_config.max_model_len) - passes + 1)
        rows = [Chunk(row.token_ids, start, row.block_row) for row in rows]
        last = self.model_config.max_model_len - 1
        inputs = eagle3.propose_inputs(self.planner, call, rows, [0] * len(rows), passes, last)
        with self.compiled.recorder.expecting(call):
            self.compiled.run_propose(call, inputs)

    @torch.no_grad()  # the grad mode serving runs in: dynamo guards on it
    def _compile_in_background(self, graph: GraphKey) -> None:
        """Compile one graph in this (background) thread by running it on synthetic requests whose blocks are
        all the null block, as warm-up does, beside serving."""
        call, parts, rows = warmup.synthetic_call(
            graph,
            self.buckets,
            max_model_len=self.model_config.max_model_len,
            blocks_per_request=self.batch.block_table.shape[1],
        )
        inputs = self.planner.inputs(call, parts, rows)
        with self.compiled.recorder.expecting(call):
            self.compiled.forward(inputs)
        self._compile_propose(graph)
        neuron_device.synchronize()

    def compile_progress(self) -> dict[str, object]:
        return self.readiness.summary()

    def lowered_graphs(self) -> list[dict[str, object]]:
        return lowered_graphs(self.recorder)

    def _log_ready(self) -> None:
        max_len = self.model_config.max_model_len
        blocks = self.kv_cache.usable_blocks
        logger.info(
            "Ready: %s mode, %d graphs, KV cache %d blocks of %d tokens (%.1f requests of max_model_len %d "
            "at once), max_num_seqs %d, at most %s prefill tokens per step while requests decode",
            neuron_device.mode(),
            self.compiled.recorder.num_graphs,
            blocks,
            self.block_size,
            blocks * self.block_size / max_len,
            max_len,
            self.neuron_config.max_num_seqs,
            self.buckets.prefill_tokens_while_decoding or "unlimited",
        )
        logger.info("%s", sampling_rows.start_up_line(self.batch.host_only))

    def shutdown(self) -> None:
        if self.device_thread is not None:
            self.device_thread.close()
        self.readiness.stop()
        if self.recorder is not None:
            self.recorder.close()
        self.step_metrics.close()

    # ---- sleep mode (worker/kv/sleep_mode.py) ------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        self.steps.finish_in_flight()
        self.readiness.pause()  # background compiles run the model on its weights and KV cache
        self.sleep_mode.sleep(level, self.compiled.models)

    def release_kv_cache(self) -> None:
        self.sleep_mode.release_kv_cache()

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.sleep_mode.wake_up(tags, lambda: self._allocate_kv_cache(self.kv_cache.config))
        if not self.sleep_mode.sleeping:
            self.readiness.resume()

    def _speculates(self, req_id: str) -> bool:
        request = self.batch.requests[req_id]
        return speculation.speculates(
            request.sampling_params, self.batch.sampling[req_id], self.batch.host_only
        )

    def _random_draws(self, row: int) -> torch.Generator | bool | None:
        """A verify row's source of uniform draws if its drafts are accepted by their probability (a random
        request that speculates); None otherwise."""
        req_id = self.batch.input_batch.req_ids[row]
        if not self._speculates(req_id) or speculation.is_greedy(self.batch.sampling[req_id]):
            return None
        return self.batch.input_batch.generators.get(row, True)

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The draft tokens proposed after the latest step, for the scheduler (None: speculation off)."""
        if self.compiled.drafts:
            drafts, self._model_drafts = self._model_drafts, None
            return drafts
        return self.drafter.take() if self.drafter is not None else None
