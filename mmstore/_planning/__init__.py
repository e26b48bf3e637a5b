"""Planning: which rows go to which rank, worker and step; pure functions, no I/O.

Owns the padded order (:mod:`.order`: units to ranks and workers by seed and epoch) and the
packed plan (:mod:`.pack`: token-balanced micro-batches per rank from per-row lengths).
Everything here is a function of a snapshot, a seed, an epoch and settings, so every rank
computes the same plan without talking. May import ``_rows`` and below.
"""
