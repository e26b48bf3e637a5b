"""Lifecycle: what happens to a store after rows are written.

Owns pins (:mod:`.pins`), gc and release (:mod:`.gc`), export of self-contained dumps
(:mod:`.export`) and verification (:mod:`.verify`). Torch-free. May import ``_rows`` and
below (never the loader).
"""
