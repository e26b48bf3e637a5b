"""Rows: rollout rows in committed Parquet files, and the checks they must pass.

Owns the rollouts table (:mod:`.table`, ``rollouts/`` as a Delta Lake table, a front over
mmstore's own log, :mod:`.log` (its records and JSON in :mod:`.entries`), and delta-rs,
:mod:`.delta`; :mod:`.versions`, one table per
open store, the files of a version, commits), per-run layout records
(:mod:`.runs`), the write-time invariants (:mod:`.invariants`), the writer (:mod:`.writer`),
access to committed files (:mod:`.files`: select, open with page checksums, partitions),
the snapshot of a version (:mod:`.snapshot`), the reader's row checks (:mod:`.check`),
per-row lengths from footers (:mod:`.lengths`), reading rows back as ``Rollout`` s
(:mod:`.readback`), and :class:`.store.Store`, the public store: storage plus its rows.
May import ``_storage``, ``_families``, ``_format`` and ``errors``.
"""
