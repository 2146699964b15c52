"""The fair policy's plain data: a tenant's entry, the prices of service, and the tuned
numbers with the measured reasons for them."""

from __future__ import annotations

from dataclasses import dataclass, field

from async_engine.core.queues import WaitQueue

PROMPT_PRICE = 1.0  # per prompt token computed
OUTPUT_PRICE = 2.0  # per token generated (the paper's prices)
NOISY_NEIGHBOUR = (
    "async-engine bench serve --tenants "
    "'a:burst=64,prompt=300,output=128;b:rate=1,duration=30,prompt=50,output=32' --alone b"
)


@dataclass(frozen=True, slots=True)
class FairTuning:
    """The fair policy's tuned numbers and the measured reasons for them.

    The figures come from the messages (and README changes) of the commits named, measured
    on a CPU (the README's runs: a 2-core AVX2 machine, float32, 2026-12-02) with the
    noisy neighbour, ``NOISY_NEIGHBOUR`` (tenant A: a burst of 64 prompts of 300 tokens;
    tenant B: a prompt of 50 tokens a second for 30 s; ``--alone b`` runs B alone as the
    baseline), which prints B's p95 TTFT against B alone and the fcfs/fair throughput
    ratio; rerun it to check a change to any of these.
    """

    # First-token steps at least this many steps apart (2: never two in a row), so the
    # other tenants' prefill and decodes keep every other step. Commit 2c36712, together
    # with its other rules (a light tenant is behind while a burst has prompts to compute,
    # goes before the burst's chunks, each admission charged at once; before it, at most
    # two first-token steps in any four): B's p95 TTFT 7.4x -> 1.8x B alone.
    first_token_step_gap: int = 2
    # A compute-bound device's steps carry this share of --max-num-batched-tokens while a
    # light tenant is behind (and was served lately, see ``trickle_steps``): its next
    # request, arriving during a step, waits for a step half as long. Commit af764f0; no
    # figure of its own was recorded.
    compute_bound_budget_share: float = 0.5
    # ...only within this many steps of the last first-token step: a trickle still
    # arriving, not a light tenant that only drains. Commit fa0fe6e: shrinking while any
    # light tenant was behind let a weighted burst's last requests halve another burst's
    # prefill for their whole drain (fair at 95.9 % and 94.5 % of fcfs throughput); with
    # the window the noisy neighbour gave fcfs/fair throughput 1.022 and 0.987 and B's p95
    # TTFT 1.82x and 1.94x alone.
    trickle_steps: int = 8
    # --fair-overflow-seqs by default, as a share of --max-num-seqs: a full batch still
    # takes a tenant behind, up to this many more, or one tenant's burst holds every slot
    # until it ends. Commit f017c2c; no figure of its own was recorded.
    overflow_share: float = 0.25


def default_overflow_seqs(max_num_seqs: int, tuning: FairTuning | None = None) -> int:
    """--fair-overflow-seqs when unset: ``overflow_share`` of --max-num-seqs, rounded down."""
    return int(max_num_seqs * (tuning or FairTuning()).overflow_share)


@dataclass(slots=True)
class Tenant:
    name: str
    weight: float
    counter: float = 0.0  # weighted service received (the virtual token counter)
    running: int = 0
    queue: WaitQueue = field(default_factory=WaitQueue)  # its waiting requests
    prompt_cost: float = PROMPT_PRICE  # per token, over the weight
    output_cost: float = OUTPUT_PRICE

    @classmethod
    def weighted(cls, name: str, weight: float) -> Tenant:
        """A new tenant whose service costs the prices over its weight."""
        return cls(
            name, weight, prompt_cost=PROMPT_PRICE / weight, output_cost=OUTPUT_PRICE / weight
        )
