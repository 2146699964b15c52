"""Other engines run on `bench offline`'s workload, for the ratios it prints: llama.cpp's
`llama-server` (`llama_server.py`) and vLLM's CPU build (`vllm_cpu.py`). Each is found by a
path the user gives (``../shared/peers/`` builds or installs them) and is skipped, by name,
when that path is missing."""


class PeerMissingError(RuntimeError):
    """The peer's binary, interpreter or model file is not at hand."""
