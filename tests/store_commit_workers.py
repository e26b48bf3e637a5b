"""Writer processes of the Store-level concurrency test: each commits through
``store.writer(...)`` (the user's path: row checks, media, run records, Parquet, rename and
the table commit), as producer ``w<index>`` with seqs 0, 1, ...

As a script (``python tests/store_commit_workers.py ROOT [--s3 JSON] ...``) it imports
mmstore once, never calls delta-rs, and forks the writers (see ``tests/table_workers.py``);
it prints what each child committed as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import mmstore
from tests.store_workers import image_bytes, make_row, small_adapter
from tests.table_workers import release_together

RUN = "conc"


def writer_child(
    root: str, s3: str | None, index: int, commits: int, rows: int, adapter: Any
) -> list[dict[str, Any]]:
    """``commits`` commits of ``rows`` rows each; every row references one image all the
    writers share (put by each: content-addressed, stored once)."""
    store = mmstore.Store.open(root, s3_options=json.loads(s3) if s3 else None)
    image = store.put_media(image_bytes(7), "png")
    done = []
    for seq in range(commits):
        with store.writer(RUN, seq % 3, producer=f"w{index}", seq=seq) as writer:
            for k in range(rows):
                writer.write(make_row(adapter, [image], f"w{index}-{seq}-{k}"))
        done.append({"path": writer.committed[0], "version": writer.version, "seq": seq})
    return done


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("root")
    parser.add_argument("--s3", default=None, help="the store's s3_options as JSON")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--commits", type=int, default=25)
    parser.add_argument("--rows", type=int, default=2)
    args = parser.parse_args(argv)
    adapter = small_adapter()  # built once in the parent: a fork shares it
    children = [
        lambda i=i: writer_child(args.root, args.s3, i, args.commits, args.rows, adapter)
        for i in range(args.procs)
    ]
    print(json.dumps(release_together(children)))


if __name__ == "__main__":
    main(sys.argv[1:])
