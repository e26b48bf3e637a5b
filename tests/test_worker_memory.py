"""DataLoader workers keep the memory they free for their next batch (glibc): a batch's large
temporaries reuse pages already faulted in instead of fresh mappings."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# Allocate and free a 24 MiB block, then print how much free memory the heap holds (MiB).
PROBE = """
import ctypes, sys
import numpy as np
from mmstore._loading.workers import init_worker

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split())]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "worker":
    init_worker(1, 0)
block = np.ones(24 << 20, dtype=np.uint8)
del block
print(libc.mallinfo2().fordblks >> 20)
"""


def _held_after_free(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], check=True, capture_output=True, text=True
    )
    return int(out.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(
    not hasattr(os, "confstr") or "CS_GNU_LIBC_VERSION" not in os.confstr_names,
    reason="glibc only",
)
def test_a_worker_keeps_a_freed_block_for_its_next_batch():
    # A fresh process hands a freed 24 MiB block back to the system (its own mapping)...
    assert _held_after_free("plain") < 24
    # ...a worker keeps it in its heap, for the next batch's temporaries of that size.
    assert _held_after_free("worker") >= 24
