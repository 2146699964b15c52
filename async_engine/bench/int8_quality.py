"""How close ``--quantization int8`` stays to float32: greedy agreement and logits cosine.

``python -m async_engine.bench.int8_quality`` runs 32 chat prompts through the float32 model
(64 greedy tokens each, all in one batch) and then through each candidate (int8 with float32
and with bfloat16 activations, and plain bfloat16 for scale) and prints, per candidate:

- free-running agreement: the share of the 32 x 64 output positions where the candidate's own
  greedy output has float32's token (after a first difference the texts usually part, so
  this undercounts how often the two models pick the same token);
- teacher-forced agreement: the share of those positions where the candidate, fed float32's
  prompt and output, ranks float32's token first;
- the cosine of its logits to float32's at every teacher-forced position (mean and minimum).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from streams.batch import ForwardBatch

BLOCK = 16
QUESTIONS = (
    "What is the capital of France?",
    "Write a short poem about the sea and the rain.",
    "2+2=",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish.",
    "Give me a recipe for pancakes.",
    "What does a CPU do?",
    "Tell me a joke about cats.",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?",
    "What is the difference between weather and climate?",
    "Write a haiku about autumn leaves.",
    "Name five fruits that are red.",
    "How many legs does a spider have?",
    "What is machine learning?",
    "Describe your ideal weekend.",
    "Why do we need sleep?",
    "Write a Python function that reverses a string.",
    "What is the boiling point of water?",
    "Give advice to someone starting a new job.",
    "What causes earthquakes?",
    "Write a two-sentence horror story.",
    "Who wrote Pride and Prejudice?",
    "How can I save money on groceries?",
    "What is the Pythagorean theorem?",
    "Describe a sunset over the mountains.",
    "What are the planets of the solar system?",
    "How do vaccines work?",
    "Write a thank-you note to a teacher.",
    "What is the largest animal on Earth?",
)


@dataclass
class Quality:
    free_running: float
    teacher_forced: float
    cosine_mean: float
    cosine_min: float


def chat_prompts(folder: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    texts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in QUESTIONS
    ]
    return [tok(t, add_special_tokens=False).input_ids for t in texts]


def _batch(seqs: list[list[int]], starts: list[int], tables: list[list[int]]) -> ForwardBatch:
    """Each sequence's tokens from ``starts[i]`` on, packed; logits for every row."""
    ids, pos, slots = [], [], []
    for seq, start, table in zip(seqs, starts, tables, strict=True):
        for p in range(start, len(seq)):
            ids.append(seq[p])
            pos.append(p)
            slots.append(table[p // BLOCK] * BLOCK + p % BLOCK)
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        slot_mapping=torch.tensor(slots),
        query_lens=[len(s) - a for s, a in zip(seqs, starts, strict=True)],
        context_lens=[len(s) for s in seqs],
        block_tables=torch.tensor(tables),
        logits_indices=torch.arange(len(ids)),
    )


def _tables(model, num_seqs: int, max_len: int) -> tuple[list[list[int]], list]:
    per_seq = -(-max_len // BLOCK)
    tables = [[1 + i * per_seq + j for j in range(per_seq)] for i in range(num_seqs)]
    return tables, model.allocate_kv_cache(1 + num_seqs * per_seq, BLOCK)


@torch.inference_mode()
def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy outputs: one packed prefill, then batched decode steps."""
    seqs = [list(p) for p in prompts]
    tables, kv = _tables(model, len(seqs), max(map(len, seqs)) + new_tokens)
    starts = [0] * len(seqs)
    for _ in range(new_tokens):
        batch = _batch(seqs, starts, tables)
        batch.logits_indices = torch.tensor(batch.query_lens).cumsum(0) - 1  # last row each
        next_ids = model(batch, kv).argmax(-1).tolist()
        starts = [len(s) for s in seqs]
        for seq, tok in zip(seqs, next_ids, strict=True):
            seq.append(tok)
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)]


@torch.inference_mode()
def forced_logits(model, prompts: list[list[int]], outputs: list[list[int]]) -> torch.Tensor:
    """Logits [sum(outputs), vocab] that predict each output token, prompt and output fed in."""
    seqs = [p + o for p, o in zip(prompts, outputs, strict=True)]
    tables, kv = _tables(model, len(seqs), max(map(len, seqs)))
    logits = model(_batch(seqs, [0] * len(seqs), tables), kv)
    rows, offset = [], 0
    for p, o in zip(prompts, outputs, strict=True):
        rows.append(torch.arange(offset + len(p) - 1, offset + len(p) + len(o) - 1))
        offset += len(p) + len(o)
    return logits[torch.cat(rows)]


def compare(model, prompts, reference: list[list[int]], ref_logits: torch.Tensor) -> Quality:
    own = greedy(model, prompts, len(reference[0]))
    same = sum(
        a == b for o, r in zip(own, reference, strict=True) for a, b in zip(o, r, strict=True)
    )
    logits = forced_logits(model, prompts, reference)
    want = torch.tensor([t for r in reference for t in r])
    cos = torch.nn.functional.cosine_similarity(logits, ref_logits, dim=-1)
    return Quality(
        free_running=same / want.numel(),
        teacher_forced=(logits.argmax(-1) == want).float().mean().item(),
        cosine_mean=cos.mean().item(),
        cosine_min=cos.min().item(),
    )


CANDIDATES = {  # name: (dtype, quantization)
    "int8 (float32 activations)": ("float32", "int8"),
    "int8 (bfloat16 activations)": ("bfloat16", "int8"),
    "bfloat16": ("bfloat16", "none"),
}


def main(argv: list[str] | None = None) -> int:
    from async_engine.model import build_model, resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)
    folder = resolve_model(args.model)
    prompts = chat_prompts(folder)
    reference_model = build_model(str(folder), "float32")
    reference = greedy(reference_model, prompts, args.max_tokens)
    ref_logits = forced_logits(reference_model, prompts, reference)
    del reference_model
    results = {}
    print(f"{len(prompts)} prompts x {args.max_tokens} greedy tokens, against float32")
    print(f"{'':30} {'free-running':>12} {'forced':>8} {'cos mean':>9} {'cos min':>8}")
    for name, (dtype, quantization) in CANDIDATES.items():
        model = build_model(str(folder), dtype, quantization=quantization)
        q = compare(model, prompts, reference, ref_logits)
        results[name] = q.__dict__
        print(
            f"{name:30} {q.free_running:12.1%} {q.teacher_forced:8.1%} "
            f"{q.cosine_mean:9.5f} {q.cosine_min:8.5f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
