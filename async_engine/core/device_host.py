"""The engine's device: what it is built from, starting it, and the link to it.

A device is a process (or, for the simulated one, a thread) started from a ``DeviceSpec``;
a restart after a loss builds a new one from the same spec, keeping the KV pool's size.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from pathlib import Path

from async_engine.core.config import EngineConfig
from async_engine.core.handoff import DeviceLink
from async_engine.model import build_model, check_draft_model, resolve_model
from async_engine.model.config import ModelConfig
from streams.device import Device, DeviceSpec
from streams.drafting import Drafter, build_drafter
from streams.factory import create_device, model_spec, sim_spec
from streams.grammar import TokenizerSource
from streams.plan import StepPlan, StepResult
from streams.sim import cost_model


class DeviceHost:
    def __init__(
        self,
        config: EngineConfig,
        model_path: Path,
        model_config: ModelConfig,
        max_model_len: int,
        on_result: Callable[[StepPlan, StepResult], None],
        wrapper: Callable[[Device], Device] | None = None,
        tokenizer_text: str | None = None,
    ) -> None:
        self.config = config
        self.model_path = model_path
        self.model_config = model_config
        self.max_model_len = max_model_len
        self.kind = config.resolved_device()
        self.dtype = config.resolved_dtype()
        self._on_result = on_result
        self._wrapper = wrapper  # tests inject faults here; the engine never does
        self.tokenizer_text = tokenizer_text  # see streams.grammar.TokenizerSource
        self.num_blocks = config.num_kv_blocks or self._default_num_blocks()
        # A GPU sizes its own pool from free memory (gpu_memory_utilization): start it first.
        self.device = self._start()
        self.num_blocks = self.num_blocks or getattr(self.device, "info", {})["num_blocks"]
        self.link = self._new_link()

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.link.attach(loop)

    def start_device(self) -> Device:
        """A new device, to replace a lost one (blocks: seconds, a model load; call it off
        the event loop, then ``use`` it on the loop)."""
        return self._start()

    def use(self, device: Device, loop: asyncio.AbstractEventLoop) -> None:
        self.device = device
        self.link = self._new_link()
        self.link.attach(loop)

    def close(self) -> None:
        self.link.detach()
        self.device.close()

    def _start(self) -> Device:
        device = create_device(self._spec(self.num_blocks or None))
        return device if self._wrapper is None else self._wrapper(device)

    def _new_link(self) -> DeviceLink:
        return DeviceLink(self.device, self._on_result, self.config.device_heartbeat_timeout_s)

    def _spec(self, num_blocks: int | None) -> DeviceSpec:
        config, mc, bs = self.config, self.model_config, self.config.block_size
        max_blocks_per_row = -(-self.max_model_len // bs)
        if self.kind == "sim":
            cost = cost_model(
                config.sim_preset,
                config.sim_step_ms,
                config.sim_token_us,
                config.sim_seq_us,
                config.sim_ctx_ns,
            )
            eos = tuple(mc.eos_token_ids)
            drafter, repeat = self._drafter(), config.sim_repeat
            return sim_spec(cost, mc.vocab_size, eos, bs, max_blocks_per_row, drafter, repeat)
        model = functools.partial(
            build_model,
            str(self.model_path),
            self.dtype,
            self.kind,
            load_format=config.load_format,
            seed=config.seed,
            quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        has_tokenizer = any(
            (self.model_path / name).exists() for name in ("tokenizer.json", "tokenizer.model")
        )
        return model_spec(
            self.kind,
            model,
            num_blocks,
            bs,
            max_blocks_per_row,
            config.resolved_device_threads(),
            TokenizerSource(str(self.model_path), self.tokenizer_text) if has_tokenizer else None,
            config.cuda_graphs,
            self._graph_max_batch(),
            config.gpu_memory_utilization,
            config.max_num_batched_tokens,
            self._drafter(),
            self._graph_tokens_per_row(),
        )

    def _drafter(self) -> Callable[[], Drafter] | None:
        """What builds the device's drafter (in the device process), if it speculates."""
        speculative = self.config.resolved_speculative()
        if speculative is None:
            return None
        draft_model = {}
        if speculative.method == "draft_model":
            folder = resolve_model(speculative.model)
            check_draft_model(self.model_path, folder)
            draft_model = {
                "model_factory": functools.partial(build_model, str(folder), self.dtype, self.kind),
                "device": self.kind,
                "block_size": self.config.block_size,
                # As many blocks as the target's pool: the draft model reads the same tokens.
                "num_blocks": self.num_blocks or 4096,
                "max_model_len": self.max_model_len,
            }
        return functools.partial(build_drafter, speculative, **draft_model)

    def _graph_tokens_per_row(self) -> int:
        """A verify step's tokens a row at most: its last token and its drafts."""
        speculative = self.config.resolved_speculative()
        return 1 if speculative is None else 1 + speculative.num_speculative_tokens

    def _graph_max_batch(self) -> int:
        # The fair policy may run --fair-overflow-seqs over max_num_seqs: graphs cover them.
        return self.config.max_num_seqs + self.config.resolved_fair_overflow_seqs()

    def _default_num_blocks(self) -> int:
        """0 where the GPU runner measures free memory itself."""
        if self.kind == "cuda":
            return 0
        mc, bs = self.model_config, self.config.block_size
        kv_dtype = self.dtype if self.config.kv_cache_dtype == "auto" else "half"
        itemsize = 4 if kv_dtype == "float32" else 2
        block_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * bs * itemsize
        # A simulated device holds no KV cache: size its pool like a GPU's.
        budget = (1 << 30) if self.kind == "cpu" else (16 << 30)
        wanted = self.config.max_num_seqs * -(-self.max_model_len // bs)
        return max(16, min(wanted, budget // block_bytes))
