"""DataLoader worker setup: torch threads, and freed memory kept for reuse."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Resident MiB after a 256 MiB tensor is freed, in a fresh interpreter (so this process's
# allocator is left alone), with or without the worker setting.
_PROBE = textwrap.dedent(
    """
    import os, sys, torch
    from mmstore._worker import keep_freed_memory
    if sys.argv[1] == "keep":
        assert keep_freed_memory()
    page = os.sysconf("SC_PAGE_SIZE")
    def resident():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * page / 2**20
    before = resident()
    x = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, touched
    del x
    print(resident() - before)
    """
)


def _kept_mib(mode: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_workers_keep_freed_memory_for_the_next_image():
    # By default glibc unmaps a block this large when it is freed: the next one page-faults
    # in afresh. A worker keeps it mapped instead.
    assert _kept_mib("default") < 32
    assert _kept_mib("keep") > 200
