"""Hand-made rollout files for the lifecycle tests: exact rows over given media."""

from __future__ import annotations

import mmstore


def commit(store, adapter, run_id, step, media_rows):
    """Commit one file with a row per entry of ``media_rows`` (each a list of MediaRefs).

    Row ``i`` is ``<run>-<step>-<i>`` with reward ``i``; returns the committed file paths.
    """
    with store.writer(run_id=run_id, step=step, adapter=adapter) as w:
        for i, media in enumerate(media_rows):
            ids = [7, *([adapter.image_token_id, 8] * len(media))]
            tokens, refs = adapter.expand(ids, media)
            w.write(
                mmstore.Rollout(
                    sample_id=f"{run_id}-{step}-{i}",
                    tokens=tokens,
                    prompt_len=len(tokens),
                    loss_mask=[False] * len(tokens),
                    images=refs,
                    reward=float(i),
                )
            )
    return w.committed
