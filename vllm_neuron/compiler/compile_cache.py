"""The persistent compile cache: one root, one folder per configuration that produces the same graphs.

TorchNeuron's NEFF cache (TORCH_NEURONX_NEFF_CACHE_DIR) and, in CPU mode, inductor's cache
(TORCHINDUCTOR_CACHE_DIR) and the xla backend's executables (VLLM_NEURON_XLA_CACHE_DIR) live in
<root>/<key>/. The key hashes everything a compiled artefact depends on (model and its config, dtype,
buckets, block size, parallelism, software and compiler versions, compiler flags, backend), so a change of
any of them starts a fresh folder instead of reusing a wrong artefact. The caches write atomically, so
several pods may share the root on a ReadWriteMany volume (see docs/compile-cache.md).
"""

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_neuron import device, envs
from vllm_neuron.upstream import torch_compile

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.lora import LoRAConfig

    from vllm_neuron.config import NeuronConfig

logger = logging.getLogger("vllm.vllm_neuron.compiler.compile_cache")

# Where each backend keeps its artefacts, and the variable that moves it.
CACHE_VARIABLES = {
    "neff": "TORCH_NEURONX_NEFF_CACHE_DIR",
    "inductor": "TORCHINDUCTOR_CACHE_DIR",
    "xla": "VLLM_NEURON_XLA_CACHE_DIR",
}


def _chosen_by_user(variable: str) -> bool:
    """Whether the user set a cache variable. Inductor writes its default location into the environment the
    first time anything asks for its cache, so that value does not count as a choice."""
    value = os.environ.get(variable)
    if value is None:
        return False
    if variable == "TORCHINDUCTOR_CACHE_DIR":
        return os.path.abspath(value) != os.path.abspath(torch_compile.inductor_default_cache_dir())
    return True


def cache_root() -> Path:
    root = envs.VLLM_NEURON_CACHE_ROOT
    if root:
        return Path(root)
    xdg_cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(xdg_cache) / "vllm-neuron" / "compile"


def key_fields(
    vllm_config: "VllmConfig", neuron_config: "NeuronConfig", tp_rank: int = 0
) -> dict[str, object]:
    model_config = vllm_config.model_config
    parallel_config = vllm_config.parallel_config
    return {
        "model": model_config.model,
        "revision": model_config.revision,
        "hf_config": model_config.hf_config.to_json_string(use_diff=False),
        "dtype": str(model_config.dtype),
        "max_model_len": model_config.max_model_len,
        "block_size": neuron_config.block_size,
        # These names are hashed into every cache key and recorded in key.json: renaming one would start every
        # compile cache cold, so they keep the names BucketConfig's fields had.
        "buckets": {
            "prefill_tokens": neuron_config.buckets.prefill_buckets,
            "decode_batch": neuron_config.buckets.decode_batch_buckets,
            "context_tokens": neuron_config.buckets.context_buckets,
            "decode_context_tokens": neuron_config.buckets.decode_context_buckets,
            "mixed_tokens": neuron_config.buckets.mixed_chunk_bucket,
            "mixed_batch": neuron_config.buckets.mixed_batch_buckets,
            "fresh_tokens": neuron_config.buckets.fresh_buckets,
        },
        "tensor_parallel_size": parallel_config.tensor_parallel_size,
        # Each rank compiles the graphs of its own shard (on Trainium, with its place in the group).
        "tensor_parallel_rank": tp_rank,
        # Logical NeuronCore size (1 or 2 physical cores per logical core on trn2): NEFFs are built for one.
        "logical_nc_config": os.environ.get("NEURON_LOGICAL_NC_CONFIG", ""),
        # neuronx-cc's own options (optimisation level, target, ...) change the NEFFs it writes.
        "neuron_cc_flags": os.environ.get("NEURON_CC_FLAGS", ""),
        # TorchNeuron's optimisation level for torch.compile graphs (-O2 where unset), read beside the flags.
        "neuron_compiler_opt_level": os.environ.get("NEURON_COMPILER_OPT_LEVEL", ""),
        "device_mode": device.mode(),
        "compile_backend": neuron_config.compile_backend,
        "versions": device.versions(),
        # The LoRA slots' shapes are in every graph; absent without --enable-lora: other keys are unchanged.
        **({"lora": _lora_fields(vllm_config.lora_config)} if vllm_config.lora_config else {}),
        # FP8 weights (online: the checkpoint's config says nothing) and an FP8 KV cache change every graph's
        # dtypes; absent when off, so other keys are unchanged.
        **({"quantization": model_config.quantization} if model_config.quantization else {}),
        **(
            {"kv_cache_dtype": vllm_config.cache_config.cache_dtype}
            if vllm_config.cache_config.cache_dtype != "auto"
            else {}
        ),
    }


def _lora_fields(lora: "LoRAConfig") -> dict[str, object]:
    return {
        "max_loras": lora.max_loras,
        "max_lora_rank": lora.max_lora_rank,
        "lora_dtype": str(lora.lora_dtype),
        "target_modules": lora.target_modules,
    }


def cache_key(fields: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


def prepare(vllm_config: "VllmConfig", neuron_config: "NeuronConfig", tp_rank: int = 0) -> Path:
    """Create this configuration's (and tensor-parallel rank's) cache folder and point the compilers at it
    (unless the user already chose their own folders). Returns the folder."""
    fields = key_fields(vllm_config, neuron_config, tp_rank)
    folder = cache_root() / cache_key(fields)
    folder.mkdir(parents=True, exist_ok=True)
    description = folder / "key.json"
    if not description.exists():
        # Human-readable record of what this folder's artefacts were compiled for.
        description.write_text(
            json.dumps({k: v for k, v in fields.items() if k != "hf_config"}, indent=2, default=str)
        )
    for name, variable in CACHE_VARIABLES.items():
        if not _chosen_by_user(variable):
            os.environ[variable] = str(folder / name)
    logger.info("Compile cache %s (%s)", folder, "warm" if is_warm(folder) else "cold")
    return folder


def is_warm(folder: Path) -> bool:
    """Whether a configuration's folder holds compiled artefacts (NEFFs, inductor's), not only key.json."""
    return artefact_count(folder) > 0


def artefact_count(folder: Path) -> int:
    return sum(1 for name in CACHE_VARIABLES for path in (folder / name).rglob("*") if path.is_file())


def neff_bytes() -> int:
    """Bytes of the NEFFs in TorchNeuron's cache folder (sharded as ab/cd/<key>.neff): this configuration's
    graphs, and the eager operations' it compiled there, where prepare() chose the folder; a folder the user
    chose may hold other configurations' too (then this errs high)."""
    value = os.environ.get(CACHE_VARIABLES["neff"])
    folder = Path(value) if value else None
    if folder is None or not folder.is_dir():
        return 0
    return sum(path.stat().st_size for path in folder.rglob("*.neff") if path.is_file())


# Key fields that describe the host a folder was compiled on rather than the configuration: what a CPU
# checking a Trainium configuration cannot know, so they are left out of the match and reported instead.
HOST_FIELDS = ("device_mode", "compile_backend", "versions", "tensor_parallel_rank", "neuron_cc_flags")


def neuron_folders(root: Path, fields: dict[str, object]) -> list[tuple[Path, dict[str, object]]]:
    """The folders under `root` compiled on Trainium for the configuration `fields` (key_fields) describes,
    whatever the rank, software versions and compiler flags they were compiled with, and their key.json."""
    wanted = _configuration(fields)
    found = []
    for description in sorted(root.glob("*/key.json")):
        try:
            recorded = json.loads(description.read_text())
        except (OSError, ValueError):
            continue
        if recorded.get("device_mode") == "neuron" and _configuration(recorded) == wanted:
            found.append((description.parent, recorded))
    return found


def configuration_key(fields: dict[str, object]) -> str:
    """A key of the configuration alone, the same on every host that lowers or compiles its graphs."""
    return cache_key({k: v for k, v in fields.items() if k not in HOST_FIELDS})


def _configuration(fields: dict[str, object]) -> dict[str, object]:
    """The fields as key.json records them (JSON types), without hf_config (not recorded) and host fields."""
    kept = {k: v for k, v in fields.items() if k not in (*HOST_FIELDS, "hf_config")}
    return json.loads(json.dumps(kept, default=str))
