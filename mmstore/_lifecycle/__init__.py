"""Lifecycle: what happens to a store after rows are written.

Owns pins (:mod:`.pins`), gc and release on the rollouts table's log (:mod:`.gc`), export of
self-contained dumps (:mod:`.export`), verification (:mod:`.verify`) and the upgrade of a
format-1 store (:mod:`.upgrade`). Torch-free. May import ``_rows`` and
below (never the loader).
"""
