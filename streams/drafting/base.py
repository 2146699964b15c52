"""The drafter contract: propose tokens to follow rows' tokens, in the device process.

A drafter runs where each row's accepted tokens are (the device's row state), so the
control plane never waits for a draft: it only grants a row draft slots, and the device
fills them (``streams.rows.RowState.layout``). Proposals must be cheap beside a step; a row
may get fewer tokens than slots, or none.

Optional flags a drafter may set: ``drafts_on_device`` (it also has ``propose_on_device``,
which drafts inside the step from the device's copy of the rows' tokens) and
``drafts_ahead`` (asked for more tokens than slots, its proposal runs past the tokens of
the steps in flight: see ``streams.drafting.ahead``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Drafter(Protocol):
    def propose(self, rows: list[int], tokens: list[np.ndarray], ks: list[int]) -> list[np.ndarray]:
        """Up to ``ks[i]`` tokens to follow ``tokens[i]`` (row ``rows[i]``'s prompt and output
        so far), for each row; int64 arrays, possibly empty."""
        ...

    def release(self, row: int, tokens: np.ndarray) -> None:
        """Row ``row``'s request ended with ``tokens`` (a drafter may learn from it)."""
        ...
