"""The calibration forward of ``--quantization int8``: each matmul input channel's range.

SmoothQuant's factors (``quantization.smoothing``) need the largest magnitude each input
channel of each matmul takes. The float model runs once at load time over fixed token ids,
with observers standing in for its matmul weights. No tokenizer or data set is needed: the
channels that run large are a property of the weights (the residual stream's few big
dimensions show up whatever the tokens), so seeded random ids find them; the first token of
each sequence is the BOS id, whose rows carry the largest values of all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from streams.batch import ForwardBatch

SEQUENCES, LENGTH, BLOCK = 4, 128, 16
SEED = 0


class Observer(nn.Module):
    """A float matmul that records ``max |x|`` per input channel over every call."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.absmax = torch.zeros(weight.shape[1])

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen = x.detach().reshape(-1, x.shape[-1]).abs().amax(0).float()
        self.absmax = torch.maximum(self.absmax, seen)
        return F.linear(x, self.weight, bias)


def calibration_ids(vocab_size: int, bos: int | None) -> list[list[int]]:
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, vocab_size, (SEQUENCES, LENGTH), generator=gen)
    if bos is not None:
        ids[:, 0] = bos
    return ids.tolist()


def _batch(seqs: list[list[int]]) -> ForwardBatch:
    """Every sequence whole, packed, in blocks of its own; logits of each last token."""
    per_seq = -(-max(map(len, seqs)) // BLOCK)
    ids, pos, slots, tables = [], [], [], []
    for i, seq in enumerate(seqs):
        table = [1 + i * per_seq + j for j in range(per_seq)]
        tables.append(table)
        ids += seq
        pos += range(len(seq))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(len(seq))]
    lens = [len(s) for s in seqs]
    return ForwardBatch(
        input_ids=torch.tensor(ids),
        positions=torch.tensor(pos),
        slot_mapping=torch.tensor(slots),
        query_lens=lens,
        context_lens=lens,
        block_tables=torch.tensor(tables),
        logits_indices=torch.tensor(lens).cumsum(0) - 1,
    )


@torch.no_grad()
def activation_absmax(
    model: nn.Module, names: tuple[str, ...], seqs: list[list[int]] | None = None
) -> dict[tuple[int, str], torch.Tensor]:
    """(layer index, weight name) -> max |input| per channel [in] over ``seqs`` (default:
    ``calibration_ids``), from one forward of the float model; the weights are put back."""
    cfg = model.cfg
    seqs = seqs or calibration_ids(cfg.vocab_size, getattr(cfg, "bos_token_id", None))
    observers: dict[tuple[int, str], Observer] = {}
    for i, layer in enumerate(model.layers):
        for name in names:
            observers[i, name] = Observer(getattr(layer, name))
            delattr(layer, name)
            setattr(layer, name, observers[i, name])
    try:
        batch = _batch(seqs)
        per_seq = batch.block_tables.shape[1]
        model(batch, model.allocate_kv_cache(1 + len(seqs) * per_seq, BLOCK))
    finally:
        for (i, name), observer in observers.items():
            delattr(model.layers[i], name)
            setattr(model.layers[i], name, observer.weight)
    return {key: observer.absmax for key, observer in observers.items()}
