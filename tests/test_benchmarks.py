"""The benchmark suite at a tiny scale: it must run and its correctness checks must hold.

Timing is never asserted; a benchmark fails here only by crashing or by a failed check.
"""

from __future__ import annotations

import json

from benchmarks import run


def test_suite_smoke(tmp_path):
    results = run.main(["--scale", "0.05", "--reps", "1", "--out", str(tmp_path)])
    assert set(results) == set(run.SUITE)
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written == [".json", ".md", ".png"]
    saved = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert set(saved["results"]) == set(run.SUITE)
    table = next(tmp_path.glob("*.md")).read_text()
    for name in ("loader", "disk", "resume", "scan"):
        for label, value in run.headline(name, results[name]):
            assert label in table and value > 0
