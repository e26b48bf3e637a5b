"""Rows: rollout rows in committed Parquet files, and the checks they must pass.

Owns the write-time invariants (:mod:`.invariants`), the writer (:mod:`.writer`), access to
committed files (:mod:`.files`: select, open with page checksums, partitions), the snapshot
of what is committed (:mod:`.snapshot`), the reader's row checks (:mod:`.check`), per-row
lengths from footers (:mod:`.lengths`), reading rows back as ``Rollout`` s
(:mod:`.readback`), and :class:`.store.Store`, the public store: storage plus its rows.
May import ``_storage``, ``_families``, ``_format`` and ``_exceptions``.
"""
