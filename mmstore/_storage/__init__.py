"""Storage: bytes in a store, on local disk or object storage.

Owns the backends (:mod:`.backends`: local files, S3 through pyarrow, atomic publish,
put-if-absent, where delta-rs finds the rollouts table), the
manifest (:mod:`.manifest`) and :class:`.store.Storage`: open or create a store, put and read
content-addressed media, resolve URIs under trusted roots. Knows nothing of rows. May import
``_format`` and ``errors``.
"""
