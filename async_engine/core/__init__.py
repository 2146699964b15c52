"""The control plane: engine loops, scheduler, KV manager, device handoff, requests and outputs."""
