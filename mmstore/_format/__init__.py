"""Format: what a store's bytes mean, independent of where they live.

Owns the row schema and its footer keys (:mod:`.schema`), the pydantic records of one image
ref, one media file and one rollout (:mod:`.models`), and media encoding: content hashes,
media paths, decoding with its bomb checks (:mod:`.media`), and the naming rule of rollout
files (:mod:`.paths`: partition paths, run ids, producers, parsing a path back). Imports
nothing of mmstore but ``mmstore.errors``; every other stage builds on it.
"""
