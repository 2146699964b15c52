"""The device process keeps a step's large temporaries (a verify step's logits) in its heap,
so a block freed after one step serves the next without fresh page faults."""

import os
import subprocess
import sys

from streams.process_device import MALLOC_TUNING

# Whether blocks of 40 to 320 MB, made and freed as steps of growing batches make their
# logits, all lie in the heap (past the environment's top pad of 256 MB too).
PROBE = """
import sys
import numpy as np
from streams.heap import keep_large_blocks_in_heap

def in_heap(address):
    with open("/proc/self/maps") as f:
        heap = [line.split()[0] for line in f if line.rstrip().endswith("[heap]")]
    spans = [tuple(int(x, 16) for x in span.split("-")) for span in heap]
    return any(lo <= address < hi for lo, hi in spans)

print(keep_large_blocks_in_heap() if sys.argv[1] == "raise" else None)
steps = []
for mb in range(40, 321, 40):
    logits = np.ones(mb << 17)
    steps.append(in_heap(logits.ctypes.data))
    del logits
print(all(steps))
"""


def probe(mode: str, **extra: str) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env = {**env, **MALLOC_TUNING, **extra}
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], out[1]


def test_a_large_block_comes_from_the_device_process_heap():
    assert probe("raise") == (str(1 << 30), "True")


def test_at_glibcs_default_maximum_threshold_large_blocks_get_mappings_of_their_own():
    # The device process's setting before: every verify step's logits page-faulted afresh.
    assert probe("leave", MALLOC_MMAP_THRESHOLD_=str(32 << 20)) == ("None", "False")


def test_the_callers_mmap_threshold_wins():
    assert probe("raise", MALLOC_MMAP_THRESHOLD_=str(1 << 20)) == ("None", "False")
