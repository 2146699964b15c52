"""The model's forward on paged, chunked batches: logits and greedy parity with HF transformers
on tiny random models and the default model, bfloat16 against float32, and dummy weights
from a config.json alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import make_tiny_llama

from async_engine.model import LlamaModel, build_model, resolve_model
from streams.batch import ForwardBatch

BLOCK = 4  # small blocks so short test sequences still span several, out of order


class PagedSequences:
    """Token streams with scattered block tables; builds ForwardBatch for chosen chunks."""

    def __init__(self, tokens: list[list[int]], block_size: int, max_blocks: int) -> None:
        self.tokens, self.block_size = tokens, block_size
        self.done = [0] * len(tokens)  # tokens already in the KV cache
        # Interleaved, descending block ids, never block 0: any paging mistake shows up.
        n = len(tokens)
        self.tables = [[1 + i + n * j for j in range(max_blocks)][::-1] for i in range(n)]
        self.num_blocks = 1 + n * max_blocks

    def batch(self, chunks: list[tuple[int, int]]) -> ForwardBatch:
        """``chunks``: (sequence, number of new tokens) in packing order."""
        ids, pos, slots, q_lens, ctx_lens, last = [], [], [], [], [], []
        for seq, n in chunks:
            start = self.done[seq]
            for p in range(start, start + n):
                ids.append(self.tokens[seq][p])
                pos.append(p)
                slots.append(
                    self.tables[seq][p // self.block_size] * self.block_size + p % self.block_size
                )
            self.done[seq] += n
            q_lens.append(n)
            ctx_lens.append(start + n)
            last.append(len(ids) - 1)
        return ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(pos),
            slot_mapping=torch.tensor(slots),
            query_lens=q_lens,
            context_lens=ctx_lens,
            block_tables=torch.tensor([self.tables[s] for s, _ in chunks]),
            logits_indices=torch.arange(len(ids)),  # every row, to compare them all
        )


@pytest.fixture(scope="session")
def default_folder() -> Path:
    return resolve_model("default")


# --- logits parity on tiny random models ----------------------------------------------------

TINY_CASES = {
    "llama": {"architecture": "LlamaForCausalLM"},
    "llama-tied-llama3-rope": {
        "architecture": "LlamaForCausalLM",
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    },
    "qwen2-bias": {"architecture": "Qwen2ForCausalLM"},
    "qwen3-qk-norm": {"architecture": "Qwen3ForCausalLM", "head_dim": 32},
    "mistral": {"architecture": "MistralForCausalLM", "sliding_window": None},
}


@pytest.fixture(scope="module", params=list(TINY_CASES))
def tiny(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    from transformers import AutoModelForCausalLM

    folder = make_tiny_llama(tmp_path_factory.mktemp(request.param), **TINY_CASES[request.param])
    return folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _heads_last(out: torch.Tensor) -> torch.Tensor:
    """The same values in the memory layout CUDA's SDPA kernels return ([B, L, H, D] memory
    seen as [B, H, L, D]): not viewable as rows."""
    return out.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("decode_path", ["kernel", "sdpa", "sdpa-heads-last", "bmm"])
def test_tiny_logits_match_hf(tiny, decode_path: str, monkeypatch) -> None:
    import torch.nn.functional as F

    from async_engine.model import cpu_kernels

    if decode_path == "kernel" and not cpu_kernels.available():
        pytest.skip("no C++ compiler for the CPU kernel")
    if decode_path != "kernel":  # the torch fallbacks, as on a machine without a compiler
        monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    if decode_path == "sdpa-heads-last":
        sdpa = F.scaled_dot_product_attention
        monkeypatch.setattr(
            F, "scaled_dot_product_attention", lambda *a, **k: _heads_last(sdpa(*a, **k))
        )
    folder, hf = tiny
    model = build_model(str(folder), "float32")
    model.decode_bmm = decode_path == "bmm"  # exercise every decode path in float32
    gen = torch.Generator().manual_seed(0)
    lengths = [11, 19, 28]
    tokens = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in lengths]
    with torch.inference_mode():
        expected = [hf(torch.tensor([t])).logits[0] for t in tokens]
    seqs = PagedSequences(tokens, BLOCK, max_blocks=8)
    kv = model.allocate_kv_cache(seqs.num_blocks, BLOCK)
    steps = [
        [(0, 5), (1, 9), (2, 3)],  # packed prefill, lengths differ
        [(2, 14), (0, 1), (1, 6)],  # chunked prefill over a cached prefix, mixed with decode
        [(1, 1), (0, 1), (2, 1)],  # pure decode, out of order
        [(0, 1), (2, 1), (1, 1)],
        [(2, 7), (1, 1), (0, 1)],
        [(0, 1), (1, 1), (2, 1)],
    ]
    for chunks in steps:
        starts = [seqs.done[s] for s, _ in chunks]
        with torch.inference_mode():
            got = model(seqs.batch(chunks), kv)
        want = torch.cat([expected[s][a : a + n] for (s, n), a in zip(chunks, starts, strict=True)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_bfloat16_close_to_float32(tiny) -> None:
    folder, _ = tiny
    tokens = [torch.arange(3, 40).tolist(), torch.arange(50, 60).tolist()]
    out = {}
    for dtype in ("float32", "bfloat16"):
        model = build_model(str(folder), dtype)
        seqs = PagedSequences(tokens, BLOCK, max_blocks=12)
        kv = model.allocate_kv_cache(seqs.num_blocks, BLOCK)
        with torch.inference_mode():
            model(seqs.batch([(0, 30), (1, 9)]), kv)
            out[dtype] = model(seqs.batch([(0, 1), (1, 1)]), kv)
    cos = torch.nn.functional.cosine_similarity(out["float32"], out["bfloat16"], dim=-1)
    assert out["bfloat16"].dtype == torch.float32 and cos.min() > 0.99


def test_forward_rejects_bad_batch(tmp_path: Path) -> None:
    model = build_model(str(make_tiny_llama(tmp_path, num_layers=1)), "float32")
    seqs = PagedSequences([[1, 2, 3]], BLOCK, max_blocks=2)
    batch = seqs.batch([(0, 3)])
    batch.context_lens = [2]  # fewer than its query tokens
    with pytest.raises(ValueError, match="query_len 3 with context_len 2"):
        model(batch, model.allocate_kv_cache(seqs.num_blocks, BLOCK))


# --- dummy weights: config.json alone -------------------------------------------------------

TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],  # qk-norm too: every kind of weight gets filled
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "eos_token_id": 0,
}


@pytest.fixture
def config_only(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path


def test_dummy_weights_run_a_forward(config_only: Path) -> None:
    model = build_model(str(config_only), "float32", load_format="dummy")
    assert torch.equal(model.layers[0].input_norm, torch.ones(32))
    assert torch.equal(model.layers[0].qk_norm, torch.ones(6, 8))
    std = model.embed.std().item()
    assert 0.015 < std < 0.025 and model.embed.abs().sum() > 0
    out = greedy(model, [[5, 6, 7, 8, 9], [10, 11]], new_tokens=4)
    assert all(len(o) == 4 and all(0 <= t < 96 for t in o) for o in out)


def test_dummy_weights_follow_the_seed(config_only: Path) -> None:
    def weights(seed: int) -> dict[str, torch.Tensor]:
        # Packed (oneDNN) weights are opaque tensors: compare them dense.
        model = build_model(str(config_only), "float32", load_format="dummy", seed=seed)
        return {n: p.to_dense() if p.is_mkldnn else p for n, p in model.named_parameters()}

    first, again, other = weights(0), weights(0), weights(1)
    assert first.keys() == again.keys()
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert not torch.equal(first["embed"], other["embed"])


def test_auto_on_a_config_only_folder_names_the_missing_weights(config_only: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors.*load_format='dummy'"):
        build_model(str(config_only), "float32")


def test_llm_generates_from_a_config_only_folder(config_only: Path) -> None:
    from async_engine.core.llm import LLM
    from sampler.params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    with LLM(
        model=str(config_only), load_format="dummy", device="cpu", dtype="float32", device_threads=1
    ) as llm:
        assert llm.tokenizer is None
        outs = llm.generate([[3, 4, 5], [7, 8, 9, 10]], params)
    assert [len(o.token_ids) for o in outs] == [5, 5]
    assert all(0 <= t < 96 for o in outs for t in o.token_ids)


# --- the default model: greedy parity with HF generate() -------------------------------------


def greedy(model: LlamaModel, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """One packed prefill, then batched decode steps; block size 16 like the engine."""
    seqs = PagedSequences([list(p) for p in prompts], 16, max_blocks=8)
    kv = model.allocate_kv_cache(seqs.num_blocks, 16)
    chunks = [(i, len(p)) for i, p in enumerate(prompts)]
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(new_tokens):
        batch = seqs.batch(chunks)
        batch.logits_indices = torch.tensor(batch.query_lens).cumsum(0) - 1  # last row each
        with torch.inference_mode():
            next_ids = model(batch, kv).argmax(-1).tolist()
        for i, tok in enumerate(next_ids):
            outputs[i].append(tok)
            seqs.tokens[i].append(tok)
        chunks = [(i, 1) for i in range(len(prompts))]
    return outputs


@pytest.fixture
def one_thread():
    # Two OpenMP threads on a shared 2-core machine spin against other work: 1 is steadier.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_default_greedy_matches_hf_generate(default_folder: Path, one_thread) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_folder)
    questions = [
        "What is the capital of France?",
        "Write a short poem about the sea and the rain.",
        "2+2=",
    ]
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    assert len({len(p) for p in prompts}) == 3  # packed sequences of different lengths
    model = build_model(str(default_folder), "float32")
    ours = greedy(model, prompts, 16)

    hf = AutoModelForCausalLM.from_pretrained(default_folder, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours, strict=True):
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
            )
        want = out[0, len(prompt) :].tolist()
        assert got[: len(want)] == want  # HF stops early at EOS; we keep going
        assert len(want) == 16 or want[-1] in model.cfg.eos_token_ids
