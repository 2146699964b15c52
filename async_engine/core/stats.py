"""Engine statistics: load for balancers, and how long the device waited on the control plane."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from async_engine.core.scheduler import Scheduler
from async_engine.core.supervisor import Supervisor
from async_engine.core.timeline import DeviceTimeline, PhaseClock
from blockalloc import BlockPool


@dataclass(slots=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_usage: float
    device_idle_fraction: float  # over the recent window of steps
    device_busy_seconds: float  # lifetime
    device_idle_seconds: float  # lifetime: waiting for a plan while requests had work
    steps: int
    num_preemptions: int
    wasted_tokens: int
    prefix_cache_queries: int  # tokens of full prompt blocks looked up, lifetime
    prefix_cache_hits: int  # tokens of those found cached (vLLM counts tokens too)
    phase_seconds: dict[str, float]  # control-plane time per phase, lifetime totals
    phase_mean_ms: dict[str, float]  # per occurrence (about once per step)
    device_state: str  # serving | restarting | failed
    device_restarts: int  # devices replaced after a loss, lifetime
    planning_mode: str  # overlap | after-step | sync: how the last step was planned
    # Speculative decoding (zeros without it): vLLM's spec_decode counts, lifetime.
    spec_num_drafts: int = 0  # row-steps that verified at least one draft
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)
    spec_acceptance_rate: float = 0.0  # accepted / drafted
    spec_mean_accepted_length: float = 0.0  # tokens a verifying row emitted per step
    spec_verify_steps: int = 0
    spec_verify_device_seconds: float = 0.0
    spec_verify_extra_device_seconds: float = 0.0  # beyond the same steps without drafts
    spec_gated_steps: int = 0  # slots granted, refused: speculating measured slower there

    @classmethod
    def collect(
        cls,
        pool: BlockPool,
        sched: Scheduler,
        timeline: DeviceTimeline,
        phases: PhaseClock,
        supervisor: Supervisor,
        planning_mode: str,
    ) -> EngineStats:
        return cls(
            running=sched.num_running,
            waiting=sched.num_waiting,
            kv_blocks_total=pool.num_blocks,
            kv_blocks_used=pool.num_used,
            kv_blocks_free=pool.num_free,
            kv_usage=pool.num_used / pool.num_blocks,
            device_idle_fraction=timeline.idle_fraction(),
            device_busy_seconds=timeline.busy_seconds,
            device_idle_seconds=timeline.idle_seconds,
            steps=timeline.steps,
            num_preemptions=sched.preemption.count,
            wasted_tokens=sched.wasted_tokens,
            prefix_cache_queries=pool.prefix_queries,
            prefix_cache_hits=pool.prefix_hits,
            phase_seconds=dict(phases.seconds),
            phase_mean_ms=phases.mean_ms(),
            device_state=supervisor.state.value,
            device_restarts=supervisor.restarts,
            planning_mode=planning_mode,
            **_speculation(sched),
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _speculation(sched: Scheduler) -> dict[str, Any]:
    if sched.speculation is None:
        return {}
    spec = sched.speculation.stats
    return {
        "spec_num_drafts": spec.num_drafts,
        "spec_num_draft_tokens": spec.num_draft_tokens,
        "spec_num_accepted_tokens": spec.num_accepted_tokens,
        "spec_accepted_per_position": list(spec.accepted_per_position),
        "spec_acceptance_rate": spec.acceptance_rate,
        "spec_mean_accepted_length": spec.mean_accepted_length,
        "spec_verify_steps": spec.verify_steps,
        "spec_verify_device_seconds": spec.verify_device_seconds,
        "spec_verify_extra_device_seconds": spec.verify_extra_device_seconds,
        "spec_gated_steps": spec.gated_steps,
    }
