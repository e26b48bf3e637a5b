"""Synthetic images and rollouts, for tutorials, demos and tests of code built on mmstore.

``screenshot(seed, width, height)`` draws a deterministic UI-like screenshot (compressible
like real ones), ``photo(seed, width, height)`` a photo-like image (incompressible), and
``grpo_rollouts(store, adapter, groups=...)`` yields GRPO groups of :class:`mmstore.Rollout`
whose samples share their prompt images, written through the public path: ``put_image``,
``adapter.expand``, ``Rollout``. Rewards are 0 or 1 at random, advantages ``reward - 0.5``.
"""

from __future__ import annotations

from ._synth import grpo_rollouts, photo, screenshot

__all__ = ["grpo_rollouts", "photo", "screenshot"]
