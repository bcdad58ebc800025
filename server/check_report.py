"""`vllm-neuron check`'s findings as values: the verdict, the bucket plan and its graphs, memory and capacity
per tensor-parallel size on trn2, decode throughput on the roofline and what it costs. `assess` derives the
figures from the capacity model (vllm_neuron/planning/capacity.py) and the prices
(vllm_neuron/planning/pricing.py); `to_json` gives every figure to scripts; server/check_table.py writes the
table for people."""

from dataclasses import asdict, dataclass, field

from vllm_neuron import trn2
from vllm_neuron.compiler.graph_memory import Reserve
from vllm_neuron.config import NeuronConfig
from vllm_neuron.graph_plan import GraphPlan
from vllm_neuron.planning import capacity
from vllm_neuron.planning.capacity import ModelFigures, RankCapacity, Throughput
from vllm_neuron.planning.pricing import (
    DEFAULT_INSTANCE,
    INSTANCES,
    dollars_per_million_tokens,
    instance_share,
)
from vllm_neuron.trn2 import KVSettings

SERVES = "serves"


@dataclass(frozen=True)
class Verdict:
    # serves, refused, does not lower, breaks a trn2 rule, graph break, does not fit, failed
    status: str
    reason: str = ""
    call: str = ""  # the call (phase and bucket) whose graph failed
    op: str = ""
    source: str = ""  # file:line of the model or plugin code that produced the op

    @property
    def serves(self) -> bool:
        return self.status == SERVES


@dataclass(frozen=True)
class Plan:
    """The configuration `serve` resolves for trn2: limits and the bucket plan."""

    max_model_len: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    neuron: NeuronConfig
    draft_model: bool = False  # speculative decoding with a draft model: a draft graph for each shape
    head: bool = False  # with an EAGLE3 head: a propose graph for each decode shape
    # NIXL's block-copy buckets at the TP given (a gather and a scatter graph each), known once the model's
    # KV bytes are measured; () without NIXL.
    copy_buckets: tuple[int, ...] = ()

    @property
    def max_num_seqs(self) -> int:
        return self.neuron.max_num_seqs

    @property
    def graphs(self) -> dict[str, int]:
        return GraphPlan(self.neuron.buckets, self.draft_model, self.copy_buckets, self.head).by_kind()

    @property
    def largest_batch(self) -> int:
        return self.neuron.buckets.decode_batch_buckets[-1]

    @property
    def decode_contexts(self) -> list[int]:
        return self.neuron.buckets.decode_contexts()


@dataclass(frozen=True)
class Lowering:
    layers_checked: int
    layers: int
    weights: str  # "random" or "loaded"
    graphs: list[dict[str, object]]  # each graph's LoweredGraph.summary()
    seconds: float


@dataclass(frozen=True)
class Price:
    instance: str
    instance_chips: int
    dollars_per_hour: float  # the whole instance
    basis: str  # "--price-per-hour", or how the documented price buys the instance
    source: str

    def share(self, tp: int) -> float | None:
        """The share of the instance a TP group is charged: its whole chips. None beyond one instance."""
        try:
            return instance_share(capacity.chips(tp), self.instance_chips)
        except ValueError:
            return None

    def per_million(self, rate: Throughput) -> float | None:
        share = self.share(rate.tp)
        if share is None:
            return None
        return dollars_per_million_tokens(rate.tokens_per_s, self.dollars_per_hour * share)


def price(dollars_per_hour: float | None) -> Price:
    """trn2.48xlarge at its documented price, or at the hourly price given."""
    instance = INSTANCES[DEFAULT_INSTANCE]
    if dollars_per_hour is not None:
        return Price(instance.name, instance.chips, dollars_per_hour, "--price-per-hour", "")
    basis = f"{instance.basis} price, {instance.region}, read {instance.read}"
    return Price(instance.name, instance.chips, instance.dollars_per_hour, basis, instance.source)


@dataclass(frozen=True)
class TPRow:
    """One tensor-parallel size: memory per rank, and decode at the largest batch bucket with requests of
    max_model_len (as many rows as fit), over the largest decode context bucket."""

    capacity: RankCapacity
    full_length: Throughput
    dollars_per_million: float | None


@dataclass(frozen=True)
class ContextRow:
    """Decode at the suggested TP with requests that fill one decode context bucket."""

    full_batch: Throughput  # the largest batch bucket, or as many rows as fit
    single: Throughput  # one request: the per-stream ceiling
    dollars_per_million: float | None


@dataclass(frozen=True)
class CacheFolder:
    path: str
    tensor_parallel_rank: int
    artefacts: int
    versions: dict[str, str]


@dataclass(frozen=True)
class CacheReport:
    root: str
    folders: list[CacheFolder]
    note: str


@dataclass
class Report:
    model: str
    dtype: str
    verdict: Verdict
    plan: Plan | None = None
    lowering: Lowering | None = None
    cache: CacheReport | None = None
    figures: ModelFigures | None = None
    settings: KVSettings = field(default_factory=KVSettings)
    reserve: Reserve | None = None  # the graph reserve in settings, and how it was chosen
    price: Price | None = None
    rows: list[TPRow] = field(default_factory=list)
    suggested_tp: int | None = None
    contexts: list[ContextRow] = field(default_factory=list)
    suggested_buckets: NeuronConfig | None = None

    @property
    def exit_code(self) -> int:
        return 0 if self.verdict.serves else 1


def assess(report: Report, max_ranks: int) -> None:
    """Fill in capacity per TP (powers of two up to max_ranks, and the TP as given), the suggested TP, the
    throughput and cost at it, and the verdict on memory at the TP as given."""
    plan, figures, settings = report.plan, report.figures, report.settings
    sizes = sorted({*capacity.tensor_parallel_sizes(figures, max_ranks), plan.tensor_parallel_size})
    largest_context = plan.decode_contexts[-1]
    for tp in sizes:
        rank = capacity.rank_capacity(figures, tp, settings)
        rate = capacity.throughput(figures, rank, plan.largest_batch, plan.max_model_len, largest_context)
        report.rows.append(TPRow(rank, rate, report.price.per_million(rate)))
    report.suggested_tp = capacity.suggest_tensor_parallel(
        [(row.capacity, row.full_length) for row in report.rows]
    )
    if report.suggested_tp is not None:
        rank = next(row.capacity for row in report.rows if row.capacity.tp == report.suggested_tp)
        for context in plan.decode_contexts:
            full = capacity.throughput(figures, rank, plan.largest_batch, context, context)
            single = capacity.throughput(figures, rank, 1, context, context)
            report.contexts.append(ContextRow(full, single, report.price.per_million(full)))
    given = next(row.capacity for row in report.rows if row.capacity.tp == plan.tensor_parallel_size)
    if report.verdict.serves and given.requests(plan.max_model_len) < 1:
        report.verdict = Verdict("does not fit", _misfit(report, given))


def _misfit(report: Report, given: RankCapacity) -> str:
    gib = trn2.GIB
    if given.kv_tokens == 0:
        settings = report.settings
        why = (
            f"at --tensor-parallel-size {given.tp} a rank's weights ({given.weight_bytes / gib:.1f} GiB), "
            f"its KV share ({settings.kv_cache_fraction} of {trn2.RANK_HBM_BYTES / gib:.0f} GiB) and "
            f"{settings.graph_reserve_bytes / gib:.2f} GiB for graphs exceed "
            f"{settings.gpu_memory_utilization} of a trn2 core"
        )
    else:
        why = (
            f"at --tensor-parallel-size {given.tp} a rank holds KV for {given.kv_tokens:,} tokens, less "
            f"than one request of max_model_len {report.plan.max_model_len}"
        )
    if report.suggested_tp is not None:
        return f"{why}: use --tensor-parallel-size {report.suggested_tp}"
    return f"{why}: no tensor-parallel size on one instance holds a request; lower --max-model-len"


def to_json(report: Report) -> dict[str, object]:
    """Every figure of the report, for scripts."""
    out: dict[str, object] = {
        "model": report.model,
        "dtype": report.dtype,
        "verdict": {**asdict(report.verdict), "serves": report.verdict.serves, "exit_code": report.exit_code},
    }
    plan = report.plan
    if plan is not None:
        graphs = plan.graphs
        out["plan"] = {
            "max_model_len": plan.max_model_len,
            "max_num_seqs": plan.max_num_seqs,
            "max_num_batched_tokens": plan.max_num_batched_tokens,
            "tensor_parallel_size": plan.tensor_parallel_size,
            "block_size": plan.neuron.block_size,
            "buckets": plan.neuron.as_additional_config(),
            "graphs": {**graphs, "total": sum(graphs.values())},
        }
        out["compile_estimate"] = _compile_json(sum(graphs.values()), report)
    if report.lowering is not None:
        out["lowering"] = {**asdict(report.lowering), "graphs_lowered": len(report.lowering.graphs)}
    if report.cache is not None:
        out["compile_cache"] = asdict(report.cache)
    if report.reserve is not None:
        out["graph_reserve"] = report.reserve.as_dict()
    if report.figures is not None:
        figures = report.figures
        out["model_figures"] = {**asdict(figures), "kv_bytes_per_token": figures.kv_bytes_per_token()}
        out["trn2"] = {
            "rank_hbm_bytes": trn2.RANK_HBM_BYTES,
            "rank_hbm_bytes_per_s": trn2.RANK_HBM_BW,
            "ranks_per_chip": trn2.RANKS_PER_CHIP,
            **asdict(report.settings),
        }
        out["price"] = asdict(report.price)
        out["tensor_parallel"] = [_row_json(row, plan) for row in report.rows]
        out["suggested"] = {"tensor_parallel_size": report.suggested_tp}
        if report.suggested_buckets is not None:
            suggested = report.suggested_buckets
            out["suggested"]["buckets"] = suggested.as_additional_config()
            out["suggested"]["graphs"] = suggested.buckets.num_graphs
            out["suggested"]["compile_estimate"] = _compile_json(suggested.buckets.num_graphs, report)
        out["throughput"] = [_context_json(row) for row in report.contexts]
    return out


def _compile_json(graphs: int, report: Report) -> dict[str, object] | None:
    if report.figures is None:
        return None
    low, high = capacity.compile_seconds(graphs, _layers(report))
    return {"graphs": graphs, "seconds_low": low, "seconds_high": high, "basis": capacity.COMPILE_BASIS}


def _layers(report: Report) -> int:
    return report.lowering.layers if report.lowering is not None else report.figures.layers


def _row_json(row: TPRow, plan: Plan) -> dict[str, object]:
    return {
        **asdict(row.capacity),
        "requests_of_max_model_len": row.capacity.requests(plan.max_model_len),
        "decode": _rate_json(row.full_length),
        "dollars_per_million_output_tokens": row.dollars_per_million,
    }


def _context_json(row: ContextRow) -> dict[str, object]:
    return {
        "context_bucket": row.full_batch.context_bucket,
        "full_batch": _rate_json(row.full_batch),
        "one_request": _rate_json(row.single),
        "dollars_per_million_output_tokens": row.dollars_per_million,
    }


def _rate_json(rate: Throughput) -> dict[str, object]:
    return {**asdict(rate), "tokens_per_s": rate.tokens_per_s}
