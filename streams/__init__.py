"""Device side of the handoff: step plans in, sampled tokens out.

Nothing here imports asyncio; the control plane watches ``Device.completion_fd()``.
Keep this file free of heavy imports: the scheduler imports ``streams.plan``.
"""
