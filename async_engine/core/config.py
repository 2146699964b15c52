"""Engine settings. Every limit a user can set lives here, validated once.

Each field's ``help`` metadata is what the command line shows: the CLI generates its engine
flags from these fields, so a default is written in one place only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from async_engine.core.hardware import cpu_has_fast_bf16, default_device
from async_engine.core.policy import POLICIES, Policy, default_overflow_seqs, make_policy
from async_engine.core.step_clock import PLANNINGS
from streams.drafting.config import SpeculativeConfig, parse_speculative_config
from streams.sim import PRESETS as SIM_PRESETS

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "sim")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("none", "int8")  # async_engine/model/quantization.py
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16")
KV_EVENT_ENCODINGS = ("map", "array")
ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


def _opt(default: object, help: str, choices: tuple[str, ...] | None = None) -> object:
    return field(default=default, metadata={"help": help, "choices": choices})


def usable_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


@dataclass(slots=True)
class EngineConfig:
    model: str = _opt("default", "default | HF folder | .gguf file")
    dtype: str = _opt("auto", "weights and activations (auto: bfloat16 where fast)", DTYPES)
    device: str = _opt("auto", "where steps run (sim: a modelled device, no weights)", DEVICES)
    load_format: str = _opt("auto", "dummy: random weights from config.json alone", LOAD_FORMATS)
    quantization: str = _opt(
        "none",
        "int8: the layers' matmul weights in int8 (per-channel scales, set at load) and their "
        "inputs per token, a few outlier channels kept in float; CPU only",
        QUANTIZATIONS,
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV cache storage: auto (the model's dtype), or bfloat16/float16 under a float32 model: "
        "half the memory and half the bytes decode attention reads; CPU only",
        KV_CACHE_DTYPES,
    )
    overlap: bool = _opt(
        True,
        "plan step N+1 while step N runs (see --planning); off: plan after each step, always",
    )
    planning: str = _opt(
        "auto",
        "with overlap, when step N+1 is planned: overlap (while step N runs), after-step (once "
        "N ends, waiting at most 1.25x its expected time: a request arriving meanwhile rides "
        "N+1), auto (after-step where the control plane's work is under 2 percent of a step, as on "
        "a CPU); stats().planning_mode says which ran last",
        PLANNINGS,
    )
    cuda_graphs: bool = _opt(True, "decode steps replay CUDA graphs in padded batch buckets")
    gpu_memory_utilization: float = _opt(
        0.9, "share of the GPU's memory the device may use (weights, activations, KV pool)"
    )
    block_size: int = _opt(16, "tokens per KV block")
    num_kv_blocks: int | None = _opt(None, "KV pool size (default: from max seqs and length)")
    max_num_seqs: int = _opt(
        64, "requests running at once: a hard limit, but for --fair-overflow-seqs under fair"
    )
    max_num_batched_tokens: int = _opt(512, "per-step token budget (chunked prefill)")
    max_model_len: int | None = _opt(None, "context limit (default: the model's)")
    max_waiting: int = _opt(4096, "queue limit; past it, submissions are refused")
    scheduling_policy: str = _opt(
        "fair", "admission order: fair (tenants share by weight), priority, or fcfs", POLICIES
    )
    tenant_weights: str | None = _opt(None, "fair shares, e.g. 'a=2,b=1' (others: the default)")
    default_tenant_weight: float = _opt(1.0, "weight of a tenant tenant_weights does not name")
    fair_overflow_seqs: int | None = _opt(
        None,
        "extra running slots the fair policy may give a tenant that is behind when the batch "
        "is full; default a quarter of --max-num-seqs; 0 keeps --max-num-seqs a hard limit",
    )
    enable_prefix_cache: bool = _opt(True, "share KV blocks of identical prompt prefixes")
    kv_events_endpoint: str | None = _opt(
        None,
        "publish prefix-cache KV events in vLLM's format (ZMQ PUB) for prefix-aware routers: "
        "tcp://*:5557 binds, tcp://host:5557 connects (to an indexer that binds, as llm-d's)",
    )
    kv_events_replay_endpoint: str | None = _opt(
        None, "ZMQ ROUTER address (binds) that resends recent KV event batches from a seq number"
    )
    kv_events_topic: str = _opt("", "topic frame of KV event messages (llm-d: kv@<pod>@<model>)")
    kv_events_encoding: str = _opt(
        "map",
        "KV events as tagged maps (vLLM >= 0.24, vllm-router 0.1.17) or positional arrays "
        "(vLLM <= 0.23, llm-d-kv-cache-manager); both batches are arrays",
        KV_EVENT_ENCODINGS,
    )
    device_threads: int | None = _opt(None, "CPU device threads (default: every core)")
    max_unread_bytes_per_stream: int = _opt(
        16 << 20, "a stream whose unread output outgrows this is ended (reader too slow)"
    )
    max_unread_bytes: int = _opt(512 << 20, "unread output of all streams together, bytes")
    device_restart_limit: int = _opt(
        5, "device restarts allowed per 10 minutes; past it the engine stops (serve exits 1)"
    )
    device_heartbeat_timeout_s: float = _opt(
        3.0, "a device whose heartbeat is quiet this long is hung: it is killed and replaced"
    )
    device_step_timeout_s: float = _opt(
        120.0, "a step running longer than this (or 20x its expected time) loses the device"
    )
    freeze_gc: bool = _opt(True, "move objects alive at start out of the garbage collector's walks")
    seed: int = _opt(0, "seed of dummy weights and of the simulated device's tokens")
    sim_preset: str | None = _opt(None, "sim device cost model preset (see streams/sim)")
    sim_step_ms: float | None = _opt(None, "sim device: fixed cost per step, ms")
    sim_token_us: float | None = _opt(None, "sim device: cost per computed token, us")
    sim_seq_us: float | None = _opt(None, "sim device: cost per sequence in the step, us")
    sim_ctx_ns: float | None = _opt(None, "sim device: cost per context token read, ns")
    sim_repeat: float = _opt(
        0.0,
        "sim device: share of positions whose token repeats what followed the last two "
        "tokens earlier in the request or its session (text for speculative decoding)",
    )
    speculative_config: str | None = _opt(
        None,
        'speculative decoding as JSON, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4}\' (methods ngram, suffix, draft_model with "model"; '
        "a dict in LLM(...)); README: Speculative decoding",
    )

    def __post_init__(self) -> None:
        for name, allowed in (
            ("dtype", DTYPES),
            ("device", DEVICES),
            ("load_format", LOAD_FORMATS),
            ("quantization", QUANTIZATIONS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("scheduling_policy", POLICIES),
            ("planning", PLANNINGS),
            ("kv_events_encoding", KV_EVENT_ENCODINGS),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be {'|'.join(allowed)}, got {getattr(self, name)!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_waiting",
            "max_unread_bytes_per_stream",
            "max_unread_bytes",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.quantization == "int8" and self.device == "cuda":
            raise ValueError("quantization int8 runs on the CPU device only, not 'cuda'")
        self._check_kv_cache_dtype()
        self.resolved_tenant_weights()  # raises on a bad spec
        self._check_kv_events()
        overflow = self.fair_overflow_seqs
        if overflow is not None and (
            isinstance(overflow, bool) or not isinstance(overflow, int) or overflow < 0
        ):
            raise ValueError(
                "fair_overflow_seqs must be an integer >= 0 (0: max_num_seqs is a hard limit; "
                f"unset: a quarter of max_num_seqs), got {overflow!r}"
            )
        weight = self.default_tenant_weight
        if not isinstance(weight, int | float) or not 0 < weight < 1e6:
            raise ValueError(f"default_tenant_weight must be a number > 0, got {weight!r}")
        if not isinstance(self.device_restart_limit, int) or self.device_restart_limit < 0:
            raise ValueError(
                f"device_restart_limit must be an integer >= 0, got {self.device_restart_limit!r}"
            )
        for name in ("device_heartbeat_timeout_s", "device_step_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0.5 <= value < 1e6:
                raise ValueError(f"{name} must be a number of seconds >= 0.5, got {value!r}")
        share = self.gpu_memory_utilization
        if not isinstance(share, int | float) or isinstance(share, bool) or not 0 < share <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {share!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.sim_preset is not None and self.sim_preset not in SIM_PRESETS:
            raise ValueError(
                f"sim_preset must be one of {', '.join(SIM_PRESETS)}, got {self.sim_preset!r}"
            )
        for name in ("sim_step_ms", "sim_token_us", "sim_seq_us", "sim_ctx_ns"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int | float) and 0 <= value < 1e9):
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if not isinstance(self.sim_repeat, int | float) or not 0 <= self.sim_repeat <= 1:
            raise ValueError(f"sim_repeat must be a share in [0, 1], got {self.sim_repeat!r}")
        speculative = self.resolved_speculative()  # raises on a bad config
        if speculative is not None and speculative.method == "draft_model" and self.device == "sim":
            raise ValueError(
                "speculative_config: method draft_model needs a model device (cpu or cuda); "
                "the simulated device runs no model (use ngram or suffix there)"
            )

    def _check_kv_events(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and value.startswith(ZMQ_SCHEMES)):
                raise ValueError(
                    f"{name} must be a ZeroMQ address like tcp://*:5557, got {value!r}"
                )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if not isinstance(self.kv_events_topic, str):
            raise ValueError(f"kv_events_topic must be a string, got {self.kv_events_topic!r}")

    def resolved_tenant_weights(self) -> dict[str, float]:
        """``tenant_weights`` parsed: 'a=2,b=1' -> {'a': 2.0, 'b': 1.0}."""
        weights: dict[str, float] = {}
        for item in (self.tenant_weights or "").split(","):
            if not item.strip():
                continue
            name, eq, value = item.strip().rpartition("=")
            try:
                weight = float(value)
            except ValueError:
                weight = float("nan")
            if not eq or not name or not 0 < weight < 1e6:
                raise ValueError(
                    f"tenant_weights must look like 'a=2,b=1' with weights > 0, got {item!r}"
                )
            weights[name] = weight
        return weights

    def resolved_fair_overflow_seqs(self) -> int:
        """Running slots past max_num_seqs the scheduling policy may use: 0 unless fair."""
        if self.scheduling_policy != "fair":
            return 0
        if self.fair_overflow_seqs is None:
            return default_overflow_seqs(self.max_num_seqs)
        return self.fair_overflow_seqs

    def build_policy(self) -> Policy:
        """The scheduling policy these settings name (``core/policy``)."""
        return make_policy(
            self.scheduling_policy,
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.resolved_tenant_weights(),
            self.default_tenant_weight,
            self.resolved_fair_overflow_seqs(),
        )

    def resolved_device(self) -> str:
        return default_device() if self.device == "auto" else self.device

    def resolved_speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (a JSON string or a dict), or None: no speculation."""
        return parse_speculative_config(self.speculative_config)

    def _check_kv_cache_dtype(self) -> None:
        kv = self.kv_cache_dtype
        if kv == "auto" or self.resolved_device() == "sim":
            return
        if self.resolved_device() != "cpu":
            raise ValueError(f"kv_cache_dtype {kv} runs on the CPU device only")
        dtype = self.resolved_dtype()
        if kv != dtype and dtype != "float32":
            raise ValueError(
                f"kv_cache_dtype {kv} needs a float32 model (dtype resolves to {dtype}); "
                "a half-precision model's cache is already half precision"
            )

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device() in ("cuda", "sim"):
            return "bfloat16"
        return "bfloat16" if cpu_has_fast_bf16() else "float32"

    def resolved_device_threads(self) -> int:
        """Every core this process may run on by default (its affinity mask: a container or
        taskset may allow fewer than the machine has): the device's steps, not the control
        plane (well under 1 % of a CPU step, see bench offline), are where the time goes."""
        if self.device_threads is not None:
            return max(1, self.device_threads)
        return usable_cores()
