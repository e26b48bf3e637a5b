"""Loading: committed rows to torch batches, in DataLoader workers.

Owns the public dataset and loader (:mod:`.dataset`) and the checks of their arguments
(:mod:`.options`), the value object describing what to read and the per-process source of
its materializer (:mod:`.spec`), materializing images (:mod:`.materialize`: hash check, decode,
processor, dtype cast), collating padded and packed batches (:mod:`.collate`,
:mod:`.microbatch`, :mod:`.packed`; every key of a batch: :mod:`.batch_keys`), the pixel
caches (:mod:`.cache` per process, :mod:`.node_cache` per node), worker plumbing
(:mod:`.workers`, :mod:`.buffers`), the device stage (:mod:`.device`, :mod:`.distinct`) and
S3 read-ahead (:mod:`.prefetch`). Needs torch.
May import ``_planning`` and below.
"""
