"""The device's row state: block tables, each row's tokens, and a step's layout from them.

Every runner applies a plan's changes here first (released rows, new rows, table resets,
appended blocks), then asks for the step's layout: starts resolved, drafts filled, and the
flat arrays its forward pass needs. Once it knows the tokens a step sampled, it records
them: each row's count of tokens grows by what it emitted (a row that verified drafts
emits its verified run plus one), and its tokens join its history, which drafters and the
simulated device read. All of it is numpy, so a step of hundreds of requests costs tens of
microseconds, not a Python loop per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streams.drafting.ahead import Chains, propose_chains
from streams.drafting.base import Drafter
from streams.plan import DRAFT, PLACEHOLDER, RESOLVE, StepPlan


@dataclass(slots=True)
class StepLayout:
    """One step as the device runs it: the plan with its starts resolved and its drafts filled
    (a row with fewer drafts than slots computes fewer tokens)."""

    rows: np.ndarray  # int64 [B]
    starts: np.ndarray  # int64 [B]
    query_lens: np.ndarray  # int64 [B]
    num_sampled: np.ndarray  # int64 [B]
    input_ids: np.ndarray  # int64 [T]; PLACEHOLDER kept (the device fills it), drafts filled
    token_rows: np.ndarray  # int64 [T]: row of each input token
    positions: np.ndarray  # int64 [T]
    kv_slots: np.ndarray  # int64 [T]: block * block_size + offset
    context_lens: np.ndarray  # int64 [B]: tokens in each request's KV after the step
    width: int  # most blocks a row of the step holds
    sample_index: np.ndarray  # int64 [S]: which inputs' logits are sampled, in order
    sample_rows: np.ndarray  # int64 [S]
    sample_offsets: np.ndarray  # int64 [S]: each one's place past its row's last output
    # int64 [S]: the draft each sampled token must equal for its row's run to go on (-1: the
    # run's last position, where nothing is drafted)
    next_drafts: np.ndarray
    drafted: np.ndarray  # int32 [sampled rows]: drafts each verifies (at most, on the device)
    # The prompt positions scored for rows that asked for prompt logprobs: input index, row,
    # position, the prompt token after it (whose logprob it gives), top-n wanted. Empty: none.
    scores: PromptScores | None = None
    # bool [B], or None where every start is known: rows whose count of tokens the host does
    # not know yet (a verify step of theirs is in flight); their starts here are the least
    # they can be, and the device moves their positions to where its own count ends.
    resolve_on_device: np.ndarray | None = None
    drafts_on_device: bool = False  # DRAFT inputs left for the device's drafter to fill
    # Drafts made ahead on the host, for the device to keep where they follow its rows'
    # tokens (``streams.drafting.ahead``): one chain per drafting row. None: the device drafts.
    chains: Chains | None = None

    @property
    def verifying(self) -> bool:
        """Whether any row verifies drafts (only then may a row emit other than one token),
        or slots for drafts the device makes, which it may find none of."""
        return bool((self.num_sampled > 1).any())

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


@dataclass(slots=True)
class PromptScores:
    index: np.ndarray  # int64 [P]: which inputs' logits are scored
    rows: np.ndarray  # int64 [P]
    positions: np.ndarray  # int64 [P]
    targets: np.ndarray  # int64 [P]: the prompt token at position + 1
    top: np.ndarray  # int64 [P]: the row's prompt_logprobs


def _constants(n: int, cache: dict[int, tuple] = {}) -> tuple[np.ndarray, ...]:  # noqa: B006
    """Read-only arrays a decode step of ``n`` rows lays out every step: ones, 0..n-1, zeros,
    and -1s (the next draft of a position that verifies none)."""
    found = cache.get(n)
    if found is None:
        found = (np.ones(n, np.int64), np.arange(n), np.zeros(n, np.int64), np.full(n, -1))
        for array in found:
            array.flags.writeable = False
        if len(cache) >= 64:
            cache.pop(next(iter(cache)))
        cache[n] = found
    return found


class RowState:
    def __init__(self, block_size: int, max_blocks_per_row: int, rows: int = 64) -> None:
        self.block_size = block_size
        self.max_blocks = max_blocks_per_row
        self.tables = np.zeros((rows, max_blocks_per_row), dtype=np.int64)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        self.live = np.zeros(rows, dtype=bool)
        # Tokens the row has (prompt + emitted), for laying steps out: exact where no verify
        # step of the row is unsettled, else the least it can be (one token a step).
        self.length = np.zeros(rows, dtype=np.int64)
        self.unsettled = np.zeros(rows, dtype=np.int64)  # verify steps whose counts are unknown
        self.known = np.zeros(rows, dtype=np.int64)  # tokens in ``history``, in order
        self.joins = np.zeros(rows, dtype=np.int64)  # requests the row has taken so far
        self.history = np.zeros((rows, 256), dtype=np.int32)  # the row's tokens
        self.prompt_len = np.zeros(rows, dtype=np.int64)
        self.score_top = np.full(rows, -1, dtype=np.int64)  # prompt_logprobs; -1: none

    # ------------------------------------------------------------- plan changes
    def apply(
        self, plan: StepPlan, drafter: Drafter | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bring the row state up to the plan: releases (their tokens go to ``drafter``),
        joins, resets, appended blocks. Returns the table entries written, as (rows,
        columns, blocks), for a device copy."""
        if len(plan.released_rows):
            if drafter is not None:
                for row in plan.released_rows.tolist():
                    drafter.release(row, self.history[row, : self.known[row]].copy())
            self.live[plan.released_rows] = False
            self.num_blocks[plan.released_rows] = 0
        for new in plan.new_rows:
            self._ensure(new.row, len(new.prompt_ids))
            self.live[new.row] = True
            self.num_blocks[new.row] = 0
            self.length[new.row] = self.known[new.row] = len(new.prompt_ids)
            self.unsettled[new.row] = 0
            self.joins[new.row] += 1
            self.history[new.row, : len(new.prompt_ids)] = new.prompt_ids
            self.prompt_len[new.row] = len(new.prompt_ids)
            wanted = getattr(new.params, "prompt_logprobs", None)
            self.score_top[new.row] = -1 if wanted is None else wanted
        if len(plan.reset_rows):
            self.num_blocks[plan.reset_rows] = 0
        pairs = plan.new_blocks
        if len(pairs):
            return self.append_blocks(pairs[0::2].astype(np.int64), pairs[1::2].astype(np.int64))
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty

    def append_blocks(
        self, rows: np.ndarray, blocks: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Append blocks to rows' tables, in the order given (a row may appear many times)."""
        order = np.argsort(rows, kind="stable")
        rows, blocks = rows[order], blocks[order]
        # Rank of each pair within its row's run: index minus the run's first index.
        first = np.r_[0, np.flatnonzero(rows[1:] != rows[:-1]) + 1]
        run_lengths = np.diff(np.r_[first, len(rows)])
        rank = np.arange(len(rows)) - np.repeat(first, run_lengths)
        columns = self.num_blocks[rows] + rank
        if (columns >= self.max_blocks).any():
            raise ValueError(f"a block table outgrew {self.max_blocks} blocks")
        self.tables[rows, columns] = blocks
        self.num_blocks[rows[first]] += run_lengths
        return rows, columns, blocks

    # ------------------------------------------------------------------- layout
    def layout(
        self,
        plan: StepPlan,
        drafter: Drafter | None = None,
        drafts_on_device: bool = False,
        every_slot: bool = False,
        unseen: np.ndarray | None = None,
    ) -> StepLayout:
        """The step's layout. RESOLVE starts read the rows' token counts: a row whose count
        is unsettled starts where the least it can hold ends, flagged for the device
        (``resolve_on_device``). Drafts: filled here from ``drafter`` (every step before that
        sampled for a drafting row must have been recorded), or, ``drafts_on_device``, left
        as DRAFT inputs for the device to fill (a row then verifies every slot it was given;
        the device cuts its run where its drafts ran out). Filled here, the slots a drafter
        leaves empty are dropped, or, ``every_slot``, kept with a filler and verified as a
        device drafter's would be (the simulated device, as a GPU). A drafter that
        ``drafts_ahead`` drafts for the device too: chains from the tokens here, past those
        of the steps in flight (``StepLayout.chains``); ``unseen`` (by row): the latest
        tokens here that it must not see (the simulated device's step in flight)."""
        layout = self._layout(plan, drafter, drafts_on_device, every_slot, unseen)
        unsettled = (plan.starts == RESOLVE) & (self.unsettled[layout.rows] > 0)
        if unsettled.any():
            layout.resolve_on_device = unsettled
        return layout

    def _layout(
        self,
        plan: StepPlan,
        drafter: Drafter | None,
        on_device: bool,
        every_slot: bool,
        unseen: np.ndarray | None,
    ) -> StepLayout:
        rows = plan.rows.astype(np.int64)
        starts = plan.starts.astype(np.int64)
        qlens = plan.query_lens.astype(np.int64)
        nsampled = plan.num_sampled.astype(np.int64)
        ids = plan.input_ids.astype(np.int64)
        resolve = starts == RESOLVE
        if resolve.any():
            starts = np.where(resolve, self.length[rows] - 1, starts)
        if len(rows) and len(ids) == len(rows) and (nsampled == 1).all():
            return self._decode_layout(rows, starts, ids)
        slots = np.maximum(nsampled - 1, 0)  # DRAFT slots: the row's last inputs
        chains = None
        if slots.any() and on_device:
            if int((ids == DRAFT).sum()) != int(slots.sum()):
                raise ValueError("a row's DRAFT slots must be its last inputs")
            drafted = slots[nsampled > 0].astype(np.int32)
            if getattr(drafter, "drafts_ahead", False):
                chains = self._chains(rows[slots > 0], slots[slots > 0], drafter, unseen)
        elif slots.any():
            ids, qlens, nsampled, drafted = self._fill_drafts(
                rows, starts, qlens, nsampled, ids, slots, drafter, every_slot
            )
        else:
            drafted = np.zeros(int((nsampled > 0).sum()), np.int32)
        token_rows = np.repeat(rows, qlens)
        # Position of each token: its row's start plus its index within the row's run.
        first = np.cumsum(qlens) - qlens
        positions = np.repeat(starts - first, qlens) + np.arange(len(token_rows))
        bs = self.block_size
        block_index = positions // bs
        if (block_index >= self.num_blocks[token_rows]).any():
            raise ValueError("a plan reads past the end of a row's block table")
        blocks = self.tables[token_rows, block_index]
        # The sampled inputs: each row's last num_sampled.
        ends = first + qlens
        sample_rows = np.repeat(rows, nsampled)
        run_first = np.cumsum(nsampled) - nsampled
        sample_offsets = np.arange(len(sample_rows)) - np.repeat(run_first, nsampled)
        sample_index = np.repeat(ends - nsampled, nsampled) + sample_offsets
        # The draft after each sampled input, within its row's drafts (-1 past them).
        runs = np.repeat(drafted, nsampled[nsampled > 0])
        following = ids[np.minimum(sample_index + 1, len(ids) - 1)]
        next_drafts = np.where(sample_offsets < runs, following, -1)
        scores = self._scores(token_rows, positions) if (self.score_top[rows] >= 0).any() else None
        return StepLayout(
            rows=rows,
            starts=starts,
            query_lens=qlens,
            num_sampled=nsampled,
            input_ids=ids,
            token_rows=token_rows,
            positions=positions,
            kv_slots=blocks * bs + positions % bs,
            context_lens=starts + qlens,
            width=int(self.num_blocks[rows].max()) if len(rows) else 0,
            sample_index=sample_index,
            sample_rows=sample_rows,
            sample_offsets=sample_offsets,
            next_drafts=next_drafts,
            drafted=drafted,
            scores=scores,
            drafts_on_device=on_device and bool(slots.any()),
            chains=chains,
        )

    def _chains(
        self, rows: np.ndarray, slots: np.ndarray, drafter: Drafter, unseen: np.ndarray | None
    ) -> Chains:
        """Each drafting row's chain from the tokens here: long enough for what its steps in
        flight may emit (each as many drafts as this step's slots, and one) and its slots."""
        known = self.known[rows] - (0 if unseen is None else unseen[rows])
        ahead = self.length[rows] - known + self.unsettled[rows] * slots
        histories = [self.history[row, :n] for row, n in zip(rows, known, strict=True)]
        return propose_chains(drafter, rows.tolist(), histories, (ahead + slots).tolist())

    def _scores(self, token_rows: np.ndarray, positions: np.ndarray) -> PromptScores | None:
        """The inputs whose logits score the next prompt token, for rows that ask (a row's
        last prompt position predicts its first output: not a prompt token)."""
        wanted = (self.score_top[token_rows] >= 0) & (positions < self.prompt_len[token_rows] - 1)
        index = np.flatnonzero(wanted)
        if not len(index):
            return None
        rows, at = token_rows[index], positions[index]
        return PromptScores(
            index, rows, at, self.history[rows, at + 1].astype(np.int64), self.score_top[rows]
        )

    def _decode_layout(self, rows: np.ndarray, starts: np.ndarray, ids: np.ndarray) -> StepLayout:
        """A decode step's layout (one token each, each sampled): most arrays are the rows'."""
        n, bs = len(rows), self.block_size
        block_index = starts // bs
        if (block_index >= self.num_blocks[rows]).any():
            raise ValueError("a plan reads past the end of a row's block table")
        ones, counting, zeros, none = _constants(n)
        return StepLayout(
            rows=rows,
            starts=starts,
            query_lens=ones,
            num_sampled=ones,
            input_ids=ids,
            token_rows=rows,
            positions=starts,
            kv_slots=self.tables[rows, block_index] * bs + starts % bs,
            context_lens=starts + 1,
            width=int(self.num_blocks[rows].max()),
            sample_index=counting,
            sample_rows=rows,
            sample_offsets=zeros,
            next_drafts=none,
            drafted=zeros.astype(np.int32),
        )

    def _fill_drafts(
        self,
        rows: np.ndarray,
        starts: np.ndarray,
        qlens: np.ndarray,
        nsampled: np.ndarray,
        ids: np.ndarray,
        slots: np.ndarray,
        drafter: Drafter | None,
        every_slot: bool,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """DRAFT slots filled with the drafter's tokens; slots it leaves empty are dropped,
        or, ``every_slot``, hold a filler (0). Returns the inputs, query lengths, sampled
        counts and each sampled row's drafts found."""
        if drafter is None:
            raise ValueError("a plan has DRAFT slots but the device has no drafter")
        ends = np.cumsum(qlens)
        verifying = np.flatnonzero(slots).tolist()
        for i in verifying:
            k, end, row = int(slots[i]), int(ends[i]), int(rows[i])
            if (ids[end - k : end] != DRAFT).any():
                raise ValueError("a row's DRAFT slots must be its last inputs")
            if self.known[row] != self.length[row]:
                raise ValueError(f"row {row} drafts on the host before its tokens reached it")
            if starts[i] + qlens[i] - k != self.length[row]:
                raise ValueError(
                    f"a row verifying drafts must start from its last token (row {row}: start"
                    f" {starts[i]}, {qlens[i]} tokens, {k} slots, {self.length[row]} held)"
                )
        if int((ids == DRAFT).sum()) != int(slots.sum()):
            raise ValueError("a row's DRAFT slots must be its last inputs")
        drafted = drafter.propose(
            [int(rows[i]) for i in verifying],
            [self.history[rows[i], : self.known[rows[i]]] for i in verifying],
            [int(slots[i]) for i in verifying],
        )
        pieces, filled, at = [], slots.copy(), 0
        for i, drafts in zip(verifying, drafted, strict=True):
            k, end = int(slots[i]), int(ends[i])
            drafts = np.asarray(drafts, np.int64)[:k]
            pieces += [ids[at : end - k], drafts]
            if every_slot:
                pieces.append(np.zeros(k - len(drafts), np.int64))
            filled[i] = len(drafts)
            at = end
        pieces.append(ids[at:])
        cut = 0 if every_slot else slots - filled
        return np.concatenate(pieces), qlens - cut, nsampled - cut, filled[nsampled > 0]

    # --------------------------------------------------------------- results
    def placeholder_tokens(self, layout: StepLayout) -> np.ndarray:
        """The inputs with PLACEHOLDERs filled from the rows' recorded tokens (a runner
        whose sampled tokens are all on the host: the simulated device)."""
        ids = layout.input_ids
        carried = ids == PLACEHOLDER
        if not carried.any():
            return ids
        ids = ids.copy()
        ids[carried] = self.history[layout.token_rows[carried], layout.positions[carried]]
        return ids

    def record(self, layout: StepLayout, tokens: np.ndarray, counts: np.ndarray) -> None:
        """The step emitted ``tokens`` (``counts`` per sampled row, in order): they follow
        each row's tokens, at the positions after its last."""
        self.grow(layout, counts)
        self.remember(layout, counts, tokens)

    def grow(self, layout: StepLayout, counts: np.ndarray | None = None) -> None:
        """At launch, the sampled rows' counts of tokens grow by ``counts``; None: a verify
        step whose counts the device decides, so each grows by the one token it surely
        emits and stays unsettled until ``settle``."""
        rows = layout.rows[layout.num_sampled > 0]
        if counts is None:
            self.length[rows] += 1
            self.unsettled[rows] += 1
        else:
            self.length[rows] += counts

    def joined(self, layout: StepLayout) -> np.ndarray:
        """Which request each sampled row holds (compare with ``still_held``)."""
        return self.joins[layout.rows[layout.num_sampled > 0]].copy()

    def settle(self, layout: StepLayout, counts: np.ndarray, joined: np.ndarray) -> None:
        """A step that ``grow`` left unsettled emitted ``counts``; ``joined``: the requests
        its rows held then (a row released and taken again since starts afresh)."""
        rows = layout.rows[layout.num_sampled > 0]
        held = self.joins[rows] == joined
        rows, counts = rows[held], counts[held]
        self.length[rows] += counts - 1
        self.unsettled[rows] -= 1

    def remember(
        self,
        layout: StepLayout,
        counts: np.ndarray,
        tokens: np.ndarray,
        joined: np.ndarray | None = None,
    ) -> None:
        """The emitted tokens into the rows' histories, after the tokens each had (steps are
        remembered in order); rows that took another request since ``joined`` are skipped."""
        rows = layout.rows[layout.num_sampled > 0]
        if joined is not None:
            held = self.joins[rows] == joined
            if not held.all():
                tokens = tokens[np.repeat(held, counts)]
                rows, counts = rows[held], counts[held]
        if not len(rows):
            return
        before = self.known[rows]
        self.known[rows] = before + counts
        if len(tokens) == len(rows):  # one each
            if int(before.max()) >= self.history.shape[1]:
                self._ensure(int(rows.max()), int(before.max()) + 1)
            self.history[rows, before] = tokens
            return
        self._ensure(int(rows.max()), int((before + counts).max()))
        token_rows = np.repeat(rows, counts)
        first = np.cumsum(counts) - counts
        positions = np.repeat(before - first, counts) + np.arange(len(token_rows))
        self.history[token_rows, positions] = tokens

    def table(self, row: int) -> list[int]:
        return self.tables[row, : self.num_blocks[row]].tolist()

    def _ensure(self, row: int, tokens: int) -> None:
        """Room for row ``row`` and for ``tokens`` tokens in a row's history."""
        if row >= len(self.live):
            grow = max(2 * len(self.live), row + 1)
            for name in (
                "tables", "num_blocks", "live", "length", "unsettled", "known", "joins",
                "history", "prompt_len", "score_top",
            ):  # fmt: skip
                old = getattr(self, name)
                new = np.full((grow, *old.shape[1:]), -1 if name == "score_top" else 0, old.dtype)
                new[: len(old)] = old
                setattr(self, name, new)
        if tokens > self.history.shape[1]:
            wider = np.zeros((len(self.live), max(tokens, 2 * self.history.shape[1])), np.int32)
            wider[:, : self.history.shape[1]] = self.history
            self.history = wider
