"""KV events for a prefix-aware router (llm-d): a real `vllm-neuron serve` publishes vLLM's KV events over
ZMQ, and a subscriber on 127.0.0.1 keeps a router's index of the blocks the server holds. A scripted
sequence of requests (a prompt, the same prompt again, enough others to evict it, a reset, sleep) gives
exactly the events the plugin's paged cache calls for, with the hashes a router computes from the tokens
and `/v1/neuron/info`'s block size."""

import hashlib
import json
import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import cbor2
import msgspec
import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from server.info_endpoint import describe
from tests.conftest import FEW_BUCKETS
from tests.helpers import engine_config, random_prompt
from tests.serving import API_KEY, ServerProcess, complete, free_port, http

TOPIC = "kv"
BLOCK_BYTES = 2 * 32 * 2 * 32 * 4 * 2  # K and V, 32 tokens, 2 KV heads of 32, float32, 2 layers
NUM_BLOCKS = 16  # the null block and 15 others: five prompts of 4 blocks evict the first one's
PROMPT_BLOCKS = 3  # full blocks of a prompt; its last 5 tokens and 4 generated ones share a 4th block
GENERATED = 4  # tokens each request generates (the 4 above)
PROMPT = random_prompt(PROMPT_BLOCKS * 32 + 5, seed=41)


def events_config(endpoint: str) -> dict:
    # The publisher connects to an endpoint without a wildcard: the router binds, as llm-d's does.
    return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": TOPIC}


# ---- refusals and /v1/neuron/info's section, from the configuration --------------------------------------


def test_kv_events_a_router_cannot_use_are_refused(tiny_model_dir, monkeypatch):
    config = events_config("tcp://127.0.0.1:5557")
    with pytest.raises(ValueError, match="prefix caching off publishes no block events"):
        engine_config(tiny_model_dir, kv_events_config=config, enable_prefix_caching=False)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="random seed per process"):
        engine_config(tiny_model_dir, kv_events_config=config, prefix_caching_hash_algo="xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "41")
    seeded = engine_config(tiny_model_dir, kv_events_config=config, prefix_caching_hash_algo="xxhash")
    assert describe(seeded)["kv_events"]["hash_seed"] == "PYTHONHASHSEED"  # its value stays on the server


def test_the_info_section_names_what_a_router_hashes_with(tiny_model_dir, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert describe(engine_config(tiny_model_dir))["kv_events"] is None
    config = engine_config(
        tiny_model_dir,
        kv_events_config=events_config("tcp://127.0.0.1:5557"),
        prefix_caching_hash_algo="sha256_cbor",
        block_size=16,
    )
    assert describe(config)["kv_events"] == {
        "publisher": "zmq",
        "endpoint": "tcp://127.0.0.1:5557",
        "endpoints": ["tcp://127.0.0.1:5557"],
        "replay_endpoint": None,
        "topic": TOPIC,
        "block_size": 16,
        "hash_algo": "sha256_cbor",
        "hash_seed": "vllm-none-hash",
        "block_hashes": "uint64",
    }


# ---- a router's view of a real server ---------------------------------------------------------------------


def router_hashes(tokens: list[int], block_size: int, seed: str) -> list[int]:
    """The block hashes of a prompt's full blocks as a router computes them, outside vLLM: sha256 over the
    canonical CBOR of (parent hash, block tokens, extra keys), chained from the hash of the seed, each
    published as its last 8 bytes (a big-endian uint64)."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = hashlib.sha256(cbor2.dumps((parent, block, None), canonical=True)).digest()
        hashes.append(int.from_bytes(parent, "big") & (2**64 - 1))
    return hashes


class Router:
    """A SUB socket bound on 127.0.0.1 that decodes vLLM's KVEventBatch and keeps the index of hashes the
    server holds (how many of its blocks hold each), checking that each batch's sequence number follows the
    last and each removal names a block stored before."""

    def __init__(self, endpoint: str | None = None, *, first_seq: int | None = 0) -> None:
        """first_seq: the sequence number the first batch must carry (None: any, the rest following it)."""
        self.endpoint = endpoint or f"tcp://127.0.0.1:{free_port()}"
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        self.socket.bind(self.endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.next_seq = first_seq
        self.blocks: Counter[int] = Counter()

    def receive(self, quiet_ms: int = 1500) -> list:
        """The events published since the last call: until none comes for `quiet_ms`."""
        events = []
        while self.socket.poll(quiet_ms):
            topic, seq, payload = self.socket.recv_multipart()
            seq = int.from_bytes(seq, "big")
            assert (topic.decode(), seq) == (TOPIC, seq if self.next_seq is None else self.next_seq)
            self.next_seq = seq + 1
            for event in self.decoder.decode(payload).events:
                if isinstance(event, BlockStored):
                    self.blocks.update(event.block_hashes)
                elif isinstance(event, BlockRemoved):
                    assert set(event.block_hashes) <= self.index, event
                    self.blocks.subtract(event.block_hashes)
                    self.blocks = +self.blocks
                else:
                    self.blocks.clear()
                events.append(event)
        return events

    @property
    def index(self) -> set[int]:
        return set(self.blocks)

    def close(self) -> None:
        self.socket.close(linger=0)


def stored(events: list) -> list[BlockStored]:
    return [event for event in events if isinstance(event, BlockStored)]


def removed_hashes(events: list) -> set[int]:
    return {h for event in events if isinstance(event, BlockRemoved) for h in event.block_hashes}


def counter(server: ServerProcess, name: str) -> float:
    """A vLLM counter on /metrics, summed over its labels."""
    text = http("GET", server.base + "/metrics")[1].decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name + "{"))


def prefix_cache_hits(server: ServerProcess) -> float:
    return counter(server, "vllm:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def router():
    router = Router()
    yield router
    router.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory, router):
    folder = tmp_path_factory.mktemp("kv-events")
    server = ServerProcess(
        tiny_model_dir,
        folder / "server.log",
        "--additional-config",  # after the test plan's: one bucket of each kind
        json.dumps(FEW_BUCKETS),
        "--kv-events-config",
        json.dumps(events_config(router.endpoint)),
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--kv-cache-memory-bytes",
        str(NUM_BLOCKS * BLOCK_BYTES),
        "--enable-sleep-mode",
        env={"VLLM_SERVER_DEV_MODE": "1"},  # /reset_prefix_cache and /sleep
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_events_follow_the_cache_through_hits_evictions_reset_and_sleep(server, router):
    info = json.loads(http("GET", server.base + "/v1/neuron/info", key=API_KEY)[1])["kv_events"]
    assert (info["endpoint"], info["topic"], info["hash_algo"]) == (router.endpoint, TOPIC, "sha256_cbor")
    assert info["endpoints"] == [router.endpoint]
    assert info["block_size"] == 32
    # vLLM's fixed seed, or the PYTHONHASHSEED the router shares with the server.
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    assert info["hash_seed"] == ("PYTHONHASHSEED" if "PYTHONHASHSEED" in os.environ else seed)
    assert router.receive() == []  # warm-up's calls write the null block only
    hashes = router_hashes(PROMPT, info["block_size"], seed)
    assert len(hashes) == PROMPT_BLOCKS

    # The prompt's full blocks are stored, in one or more events (prefill chunks), each chaining to the last.
    complete(server, PROMPT, GENERATED)
    events = router.receive()
    assert removed_hashes(events) == set() and len(stored(events)) >= 1
    parent = None
    for event in stored(events):
        assert event.parent_block_hash == parent and event.block_size == info["block_size"]
        parent = event.block_hashes[-1]
    assert [h for event in stored(events) for h in event.block_hashes] == hashes
    assert [t for event in stored(events) for t in event.token_ids] == PROMPT[: PROMPT_BLOCKS * 32]
    assert router.index == set(hashes)

    # The same prompt again: a prefix hit on those blocks, and nothing new to publish.
    hits = prefix_cache_hits(server)
    complete(server, PROMPT, GENERATED)
    assert router.receive() == []
    assert prefix_cache_hits(server) - hits == PROMPT_BLOCKS * 32

    # Five other prompts need 20 blocks of 15: the first prompt's are evicted, each removal published.
    others = [random_prompt(len(PROMPT), seed=100 + i) for i in range(5)]
    for prompt in others:
        complete(server, prompt, GENERATED)
    events = router.receive()
    assert set(hashes) <= removed_hashes(events) and not set(hashes) & router.index
    assert {h for prompt in others[-2:] for h in router_hashes(prompt, 32, seed)} <= router.index

    # Evicted, the prompt is prefilled again and its blocks stored again under the same hashes.
    complete(server, PROMPT, GENERATED)
    assert set(hashes) <= {h for event in stored(router.receive()) for h in event.block_hashes}

    # A reset of the prefix cache is published at once, not with the next step.
    assert http("POST", server.base + "/reset_prefix_cache")[0] == 200
    assert [type(event) for event in router.receive()] == [AllBlocksCleared] and router.index == set()

    # Sleep discards the KV cache: cleared at once; after wake-up the prompt is stored afresh.
    complete(server, PROMPT, GENERATED)
    assert set(hashes) <= router.index | {h for event in stored(router.receive()) for h in event.block_hashes}
    assert http("POST", server.base + "/sleep?level=1")[0] == 200
    assert [type(event) for event in router.receive()] == [AllBlocksCleared] and router.index == set()
    assert http("POST", server.base + "/wake_up")[0] == 200
    hits = prefix_cache_hits(server)
    complete(server, PROMPT, GENERATED)
    assert [h for event in stored(router.receive()) for h in event.block_hashes] == hashes
    assert prefix_cache_hits(server) == hits


@pytest.mark.slow
def test_preemption_keeps_the_index_true(server, router):
    """Four long requests at once need 28 blocks of 15: vLLM preempts some and recomputes them later. A
    preempted request's blocks stay cached (no event) until evicted; on resuming it hits those still there and
    stores the rest again, so the index stays exact: every removal names a block stored, every prompt's
    blocks were stored, and a reset leaves nothing."""
    router.receive()
    preemptions = counter(server, "vllm:num_preemptions_total")
    prompts = [random_prompt(len(PROMPT), seed=200 + i) for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda prompt: complete(server, prompt, max_tokens=120), prompts))
    events = router.receive()
    assert counter(server, "vllm:num_preemptions_total") > preemptions
    seed = os.environ.get("PYTHONHASHSEED", "vllm-none-hash")
    stored_hashes = {h for event in stored(events) for h in event.block_hashes}
    for prompt in prompts:
        assert set(router_hashes(prompt, 32, seed)) <= stored_hashes
    assert removed_hashes(events)  # the cache is too small to keep them all
    assert http("POST", server.base + "/reset_prefix_cache")[0] == 200
    assert [type(event) for event in router.receive()] == [AllBlocksCleared] and router.index == set()
