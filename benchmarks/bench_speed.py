"""Issue 14's figures: the torchvision backend, the node-wide pixel cache, durable writes.

    python -m benchmarks.bench_speed --scale 1 --reps 5 [--out DIR]

Every figure is oriented so that HIGHER = mmstore better (a ratio of throughputs, or of
baseline time over mmstore time), measured in one run, interleaved, median with spread:

- ``distinct.*``: one image per sample (256 at full scale), nothing shared, 2 DataLoader
  workers. mmstore with the torchvision backend over the limit with the same backend
  (workers / (decode + processor seconds per image)), over a naive map-style Dataset with
  the PIL backend (what users run today) and with the torchvision backend; PIL and
  torchvision side by side. A
  second, stricter limit decodes as the loader does for a torchvision processor (TorchCodec
  straight to a tensor) rather than with Pillow; a third, the strictest, also has the
  processor cast to bf16 right after normalizing, as the loader does (``Family.process``):
  exactly a worker's work per image, so that it shows the loader's own overhead. The
  last, "at once", runs that work in 2 processes at the same time and measures what they
  achieve, rather than assuming 2 vCPUs give twice one (here they gave 1.5-1.9x).
- ``distinct.persistent_*``: the same workload and loader with ``persistent_workers=True``,
  read in ``PASSES`` consecutive passes of one loader (a trainer's epochs over one RL step's
  rollouts): the first pass starts the workers (start-up included), the later ones start
  nothing. ``persistent_no_cache`` has each worker's image cache off, so every pass decodes
  and processes every image again: the later passes are the loader without its start-up,
  over the same limit; ``persistent_cached`` keeps the caches (the default), so later
  passes serve the images the workers kept (from the third pass: the cache keeps an image
  it meets again). The no-cache later passes are also reported over the strictest limit
  (``persistent_later_over_cast_inside_limit``): the loader's own overhead, start-up out.
  Every other loader figure here is one fresh loader's pass: start-up included.
- ``grpo8.*``: GRPO groups of 8 sharing their image (128 groups at full scale), 2 simulated
  ranks running at once (a process each, 2 workers each, one node cache directory, fresh
  per repetition), over the limit of 2 workers (the machine's 2 cores); the node cache's
  miss count next to the number of distinct images. Side by side: the same loader with
  ``distinct_images=True`` (each image once per batch: the trainer expands on its GPU, or
  runs the vision tower once per image), and that loader with the batches expanded here on
  the CPU (the cost where there is no GPU). Also over the limit at once (as above). Each
  figure is both ranks' fresh loaders' pass, start-up included; ``steady_*`` (issue 43) are
  the plain and each-image-once loaders with persistent workers, ``PASSES`` passes a rank,
  timed from both ranks' end of the first pass (a barrier) to the end of their last:
  start-up excluded. Their node cache is off and each worker's cache has room for one
  image (the one a batch's group shares), so every later pass processes each distinct
  image again (checked; a worker's last image of a pass may begin the next, one a worker).
- ``write.plain_fsync_over_mmstore``: plain file writes with one fsync per file over mmstore
  writes of the same bytes (benchmarks/bench_write.py), time over time.

At ``--scale`` below 0.5 images are a third of their size: figures are noisy, for checking
the suite runs, not for quoting. Results go to ``--out`` (default: a scratch folder, never
``benchmarks/results/``).
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import resource
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

import mmstore
from benchmarks import bench_write
from benchmarks._common import WORKLOADS, cli, interleaved, paired_ratio, single_threaded
from benchmarks.bench_loader import BATCH, NaiveDataset, _cat, build, loader_rate
from mmstore._format.media import decode_rgb_tensor

WORKERS = 2
# Consecutive passes of one loader with persistent workers: the first, then the later ones.
PASSES = 4
# Contenders never share warm state: no node cache outlives a pass.
NO_NODE_CACHE = mmstore.Materialize(node_cache_bytes=0)
BACKENDS = {"pil": Qwen2VLImageProcessorPil, "torchvision": Qwen2VLImageProcessor}


class CpuTally:
    """CPU seconds per image of each timed run, by name: a second view of every throughput,
    which excludes time the machine's neighbours take from our cores (though not their
    pressure on shared caches and memory: on 2026-12-01 CPU seconds per image moved by up to
    2.8x between runs, as wall-clock figures did)."""

    def __init__(self) -> None:
        self.runs: dict[str, list[float]] = {}

    def timed(self, name: str, run: Callable[[], tuple[float, int]]) -> float:
        """``run()`` -> (images/s, images); notes the CPU this process and its waited-for
        children (DataLoader workers, simulated ranks) spent per image."""
        before = _cpu_seconds()
        rate, images = run()
        self.runs.setdefault(name, []).append((_cpu_seconds() - before) / images)
        return rate

    def timing(
        self, runs: dict[str, Callable[[], tuple[float, int]]]
    ) -> dict[str, Callable[[], float]]:
        """``runs`` as the images/s timings :func:`interleaved` takes, each one tallied."""
        return {name: functools.partial(self.timed, name, run) for name, run in runs.items()}

    def median(self, name: str) -> float:
        return statistics.median(self.runs[name])


def _cpu_seconds() -> float:
    own, children = (
        resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
    )
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _figure(values: list[float]) -> dict[str, Any]:
    """``values`` (one per repetition) as :func:`interleaved` gives a timing's."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "n": len(values),
        "values": values,
    }


def _distinct_paths(paths: list[list[str]]) -> list[str]:
    """The workload's distinct image files, each once, sorted."""
    return sorted({p for ps in paths for p in ps})


def _decoded_tensor(path: str) -> Any:
    """The image at ``path`` as the loader decodes it for a torchvision processor: TorchCodec
    straight to a uint8 CHW tensor."""
    with open(path, "rb") as f:
        return decode_rgb_tensor(f.read())


def _worker_work(adapter: Any, path: str) -> None:
    """A loader worker's work on one image of a torchvision processor: TorchCodec decode to
    a uint8 tensor, then the processor casting to bf16 inside (``Family.process``)."""
    adapter.process([_decoded_tensor(path)], torch.bfloat16)


def _limit(
    paths: list[list[str]], proc: Any, *, tensors: bool = False, cast_inside: bool = False
) -> tuple[float, int]:
    """Images/s if each worker's core only decoded and processed (single-threaded): workers
    over the mean seconds per image of the workload's own distinct images, all of them (a
    loader's throughput is their sum; a few images' median misjudged it by up to 10%).

    Decoded with Pillow, as users do; ``tensors``: with the loader's own decode for a
    torchvision processor (TorchCodec to a uint8 tensor), the stricter reference;
    ``cast_inside``: that, and the processor casting to bf16 as the loader has it do (right
    after normalizing, ``Family.process``), the strictest: exactly a worker's work per image.
    """
    from PIL import Image

    adapter = mmstore.adapter_for(proc)

    def one(path: str) -> None:
        if cast_inside:
            _worker_work(adapter, path)
        elif tensors:
            image = _decoded_tensor(path)
            proc(images=[image], return_tensors="pt", input_data_format="channels_first")
        else:
            proc(images=[Image.open(path).convert("RGB")], return_tensors="pt")

    distinct = _distinct_paths(paths)
    with single_threaded():
        one(distinct[0])  # the first call's one-time costs (imports, allocator) are no image's
        start = time.perf_counter()
        for path in distinct:
            one(path)
        seconds = time.perf_counter() - start
    return WORKERS * len(distinct) / seconds, len(distinct)


def _limit_at_once(paths: list[list[str]], proc: Any) -> tuple[float, int]:
    """Images/s of ``WORKERS`` processes running at once, each single-threaded and doing only
    a worker's work per image (TorchCodec decode, the processor with the cast inside) on its
    share of the distinct images: the limit with the machine's own contention. :func:`_limit`
    assumes the cores scale perfectly; this VM's two vCPUs gave 1.46-1.98x one of them, not
    2x, measured this way on 2026-12-01 (the two full runs of speed-5)."""
    adapter = mmstore.adapter_for(proc)
    distinct = _distinct_paths(paths)

    def work(share: list[str]) -> None:
        torch.set_num_threads(1)  # forked: as a DataLoader worker (and see _rank)
        for path in share:
            _worker_work(adapter, path)

    with single_threaded():
        work(distinct[:1])  # one-time costs in the parent, which the workers inherit
    context = multiprocessing.get_context("fork")
    workers = [context.Process(target=work, args=(distinct[w::WORKERS],)) for w in range(WORKERS)]
    start = time.perf_counter()
    for process in workers:
        process.start()
    for process in workers:
        process.join()
    seconds = time.perf_counter() - start
    if any(process.exitcode for process in workers):
        raise RuntimeError(f"a limit worker failed: {[p.exitcode for p in workers]}")
    return len(distinct) / seconds, len(distinct)


def distinct(tmp: str, samples: int, small: bool, reps: int) -> dict[str, Any]:
    spec = {**WORKLOADS["photos"], "kind": "screenshot", "image_size": (1920, 1080)}
    if small:
        spec["image_size"] = (640, 360)
    procs = {name: cls() for name, cls in BACKENDS.items()}
    store, paths = build(f"{tmp}/distinct", spec, samples, procs["pil"])

    cpu = CpuTally()

    def ours(name: str) -> tuple[float, int]:
        ds = mmstore.RolloutDataset(store, procs[name], seed=0, materialize=NO_NODE_CACHE)
        return loader_rate(mmstore.RolloutLoader(ds, batch_size=BATCH, num_workers=WORKERS))

    def naive(name: str) -> tuple[float, int]:
        data = NaiveDataset(paths, procs[name])
        return loader_rate(DataLoader(data, BATCH, num_workers=WORKERS, collate_fn=_cat))

    runs: dict[str, Callable[[], tuple[float, int]]] = {
        "limit_torchvision": lambda: _limit(paths, procs["torchvision"]),
        "limit_torchvision_tensor": lambda: _limit(paths, procs["torchvision"], tensors=True),
        "limit_torchvision_cast_inside": (
            lambda: _limit(paths, procs["torchvision"], cast_inside=True)
        ),
        "limit_torchvision_at_once": lambda: _limit_at_once(paths, procs["torchvision"]),
        "mmstore_torchvision": lambda: ours("torchvision"),
        "naive_pil": lambda: naive("pil"),
        "naive_torchvision": lambda: naive("torchvision"),
        "limit_pil": lambda: _limit(paths, procs["pil"]),
        "mmstore_pil": lambda: ours("pil"),
    }
    passes: dict[str, list[list[float]]] = {}  # persistent contender: each rep's passes

    def persistent(name: str, settings: mmstore.Materialize) -> tuple[float, int]:
        """PASSES passes of one loader with persistent workers: the later passes' images/s
        (each pass's noted in ``passes``), and the images of all of them (CPU tally)."""
        ds = mmstore.RolloutDataset(store, procs["torchvision"], seed=0, materialize=settings)
        loader = mmstore.RolloutLoader(
            ds, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True
        )
        rates = [loader_rate(loader) for _ in range(PASSES)]
        loader.close()
        passes.setdefault(name, []).append([rate for rate, _ in rates])
        later = rates[1:]
        seconds = sum(images / rate for rate, images in later)
        return sum(images for _, images in later) / seconds, sum(n for _, n in rates)

    runs["persistent_no_cache"] = functools.partial(
        persistent, "persistent_no_cache", NO_NODE_CACHE.replace(cache_bytes=0)
    )
    runs["persistent_cached"] = functools.partial(persistent, "persistent_cached", NO_NODE_CACHE)
    figures = interleaved(cpu.timing(runs), reps)
    for name, per_rep in passes.items():  # the first passes, as interleaved gives a timing
        figures[f"{name}_first"] = _figure([rates[0] for rates in per_rep])
    return {
        "images_per_s": figures,
        "persistent_passes_images_per_s": passes,
        **ratios(
            figures,
            persistent_first_over_limit=("persistent_no_cache_first", "limit_torchvision"),
            persistent_later_over_limit=("persistent_no_cache", "limit_torchvision"),
            persistent_later_over_cast_inside_limit=(
                "persistent_no_cache",
                "limit_torchvision_cast_inside",
            ),
            persistent_later_over_limit_at_once=(
                "persistent_no_cache",
                "limit_torchvision_at_once",
            ),
            persistent_later_over_first=("persistent_no_cache", "persistent_no_cache_first"),
            persistent_later_over_fresh_loader=("persistent_no_cache", "mmstore_torchvision"),
            persistent_cached_later_over_limit=("persistent_cached", "limit_torchvision"),
            torchvision_over_limit=("mmstore_torchvision", "limit_torchvision"),
            torchvision_over_tensor_limit=("mmstore_torchvision", "limit_torchvision_tensor"),
            torchvision_over_cast_inside_limit=(
                "mmstore_torchvision",
                "limit_torchvision_cast_inside",
            ),
            torchvision_over_limit_at_once=("mmstore_torchvision", "limit_torchvision_at_once"),
            torchvision_over_naive_pil=("mmstore_torchvision", "naive_pil"),
            torchvision_over_naive_torchvision=("mmstore_torchvision", "naive_torchvision"),
            pil_over_limit=("mmstore_pil", "limit_pil"),
            pil_over_naive_pil=("mmstore_pil", "naive_pil"),
            torchvision_over_pil=("mmstore_torchvision", "mmstore_pil"),
        ),
        "cpu_seconds_per_image": {k: cpu.median(k) for k in cpu.runs},
        "cpu_limit_over_torchvision": (
            cpu.median("limit_torchvision") / cpu.median("mmstore_torchvision")
        ),
        # All PASSES passes, the first's start-up included (once, not once a pass).
        "cpu_limit_over_persistent": (
            cpu.median("limit_torchvision") / cpu.median("persistent_no_cache")
        ),
    }


# The GRPO loaders side by side: plain batches (what the model takes), batches with each
# distinct image once (what a trainer moves to its GPU and expands there, one concatenation
# on the GPU), and those expanded here on the CPU (what it costs without a GPU).
GRPO_MODES = ("plain", "distinct", "distinct_expanded_on_cpu")
# And the first two with persistent workers, timed over their later passes (start-up excluded).
STEADY_MODES = ("plain", "distinct")
RANKS = (0, 1)  # simulated ranks of one node, each its own process
RANK_TIMEOUT = 600  # seconds: a rank that died leaves the others a clear error, not a hang


def _images_in(batch: dict[str, Any]) -> int:
    """The batch's images in model order (a distinct batch: its index says)."""
    return len(batch.get("image_index", batch["image_grid_thw"]))


def _rank(
    store: mmstore.Store, proc: Any, rank: int, cache_dir: str, mode: str, results: Any
) -> None:
    """One simulated rank of 2: its loader read through, images and node-cache counts."""
    # A forked process: the parent's OpenMP threads did not come along, and torch starting
    # them here hangs (libgomp). One thread, as in the loader's forked workers.
    torch.set_num_threads(1)
    settings = mmstore.Materialize(node_cache_dir=cache_dir, distinct_images=mode != "plain")
    ds = mmstore.RolloutDataset(
        store, proc, seed=0, rank=rank, world_size=len(RANKS), materialize=settings
    )
    loader = mmstore.RolloutLoader(ds, batch_size=BATCH, num_workers=WORKERS)
    tally = {"images": 0, "hits": 0, "misses": 0}
    for b in loader:
        if mode == "distinct_expanded_on_cpu":
            b = mmstore.expand_images(b)
        tally["images"] += _images_in(b)
        tally["hits"] += b["node_cache_hits"]
        tally["misses"] += b["node_cache_misses"]
    results.put(tally)


def _steady_rank(
    store: mmstore.Store,
    proc: Any,
    rank: int,
    mode: str,
    cache_bytes: int,
    barrier: Any,
    results: Any,
) -> None:
    """One simulated rank of 2 whose workers persist: ``PASSES`` passes of one loader; after
    the first (start-up) it waits at ``barrier`` (which the parent times from) and puts the
    later passes' images and images processed on ``results``."""
    torch.set_num_threads(1)  # as in _rank
    settings = mmstore.Materialize(
        node_cache_bytes=0, cache_bytes=cache_bytes, distinct_images=mode != "plain"
    )
    ds = mmstore.RolloutDataset(
        store, proc, seed=0, rank=rank, world_size=len(RANKS), materialize=settings
    )
    loader = mmstore.RolloutLoader(
        ds, batch_size=BATCH, num_workers=WORKERS, persistent_workers=True
    )
    tally = {"images": 0, "misses": 0}
    for index in range(PASSES):
        if index == 1:
            barrier.wait(timeout=RANK_TIMEOUT)
        for b in loader:
            if index:
                tally["images"] += _images_in(b)
                tally["misses"] += b["cache_misses"]
    results.put(tally)
    loader.close()


def _at_once(
    ranks: list[Any], results: Any, barrier: Any = None
) -> tuple[list[dict[str, int]], float]:
    """Start the rank processes; each one's tally, and the seconds to the last of them,
    timed from their start or, given ``barrier``, from the moment all of them reach it."""
    start = time.perf_counter()
    for process in ranks:
        process.start()
    if barrier is not None:
        barrier.wait(timeout=RANK_TIMEOUT)
        start = time.perf_counter()
    done = [results.get(timeout=RANK_TIMEOUT) for _ in ranks]
    seconds = time.perf_counter() - start
    for process in ranks:
        process.join()
    return done, seconds


def grpo8(tmp: str, samples: int, small: bool, reps: int) -> dict[str, Any]:
    spec = {**WORKLOADS["screenshots"], "images_per_sample": 1}
    if small:
        spec["image_size"] = (640, 360)
    proc = Qwen2VLImageProcessor()
    store, paths = build(f"{tmp}/grpo8", spec, samples, proc)
    counts: dict[str, list[dict[str, int]]] = {mode: [] for mode in GRPO_MODES}
    cpu = CpuTally()

    def ours(mode: str) -> tuple[float, int]:
        # Both ranks at once, each its own process with its own workers, as on a node; one
        # node cache directory, fresh per repetition (nothing cached yet).
        # On /dev/shm, where the cache lives by default (memory), not on the scratch disk:
        # there each entry written cost 15-30 ms of writeback.
        shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tmp
        cache_dir = tempfile.mkdtemp(dir=shm, prefix="mmstore-bench-")
        context = multiprocessing.get_context("fork")
        results = context.Queue()
        ranks = [
            context.Process(target=_rank, args=(store, proc, rank, cache_dir, mode, results))
            for rank in RANKS
        ]
        done, seconds = _at_once(ranks, results)
        shutil.rmtree(cache_dir, ignore_errors=True)
        counts[mode].append({k: sum(d[k] for d in done) for k in ("hits", "misses", "images")})
        images = sum(d["images"] for d in done)
        return images / seconds, images

    distinct_images = len(_distinct_paths(paths))
    # Steady: room in each worker's cache for the image a batch's group shares, not for a
    # pass's images, and no node cache, so every later pass processes every image again
    # (checked), as a fresh loader's pass does.
    adapter = mmstore.adapter_for(proc)
    image = adapter.process([_decoded_tensor(paths[0][0])], torch.bfloat16)
    cache_bytes = int(1.5 * sum(t.numel() * t.element_size() for t in image.values()))
    processed: dict[str, list[int]] = {mode: [] for mode in STEADY_MODES}

    def steady(mode: str) -> tuple[float, int]:
        """Both ranks' later passes with persistent workers (start-up excluded): samples/s."""
        context = multiprocessing.get_context("fork")
        barrier, results = context.Barrier(len(RANKS) + 1), context.Queue()
        ranks = [
            context.Process(
                target=_steady_rank, args=(store, proc, rank, mode, cache_bytes, barrier, results)
            )
            for rank in RANKS
        ]
        done, seconds = _at_once(ranks, results, barrier)  # from the first passes' end
        misses = sum(d["misses"] for d in done)
        # A worker's cache may still hold its last image when a pass begins with it again
        # (one image a worker a pass at most), never a pass's worth.
        expected = (PASSES - 1) * distinct_images
        if not expected - (PASSES - 1) * len(RANKS) * WORKERS <= misses <= expected:
            raise RuntimeError(f"steady {mode}: {misses} images processed, expected "
                               f"{PASSES - 1} passes x {distinct_images}")  # fmt: skip
        processed[mode].append(misses)
        images = sum(d["images"] for d in done)
        return images / seconds, images

    runs: dict[str, Callable[[], tuple[float, int]]] = {
        "limit": lambda: _limit(paths, proc),
        "limit_at_once": lambda: _limit_at_once(paths, proc),
    }
    runs.update({mode: functools.partial(ours, mode) for mode in GRPO_MODES})
    runs.update({f"{mode}_steady": functools.partial(steady, mode) for mode in STEADY_MODES})
    figures = interleaved(cpu.timing(runs), reps)
    return {
        "images_per_s": figures,
        **ratios(
            figures,
            over_limit=("plain", "limit"),
            distinct_over_limit=("distinct", "limit"),
            steady_over_limit=("plain_steady", "limit"),
            steady_distinct_over_limit=("distinct_steady", "limit"),
            distinct_expanded_on_cpu_over_limit=("distinct_expanded_on_cpu", "limit"),
            over_limit_at_once=("plain", "limit_at_once"),
            distinct_over_limit_at_once=("distinct", "limit_at_once"),
        ),
        "cpu_seconds_per_image": {k: cpu.median(k) for k in cpu.runs},
        "cpu_limit_over_mmstore": cpu.median("limit") / cpu.median("plain"),
        "cpu_limit_over_distinct": cpu.median("limit") / cpu.median("distinct"),
        "distinct_images": distinct_images,
        "images": sum(len(ps) for ps in paths),
        "node_cache_per_rep": counts,
        # Steady: images the workers processed in the later passes (no node cache).
        "steady_processed_per_rep": processed,
    }


def run(scale: float = 1.0, reps: int = 3) -> dict[str, Any]:
    small = scale < 0.5
    # 256 samples at full scale: a pass of 64 (32 images a worker) measured mostly the
    # start of a pass (forking workers, their first faulted-in buffers), not its steady state.
    # GRPO 4x as many (128 groups, 64 batches a rank): with 32 groups the two ranks' start-ups
    # (about 0.5 s: forking, first buffers) were a third of the pass.
    samples = max(32, round(256 * scale))
    with tempfile.TemporaryDirectory() as tmp:
        result: dict[str, Any] = {
            "scale": scale,
            "reps": reps,
            "cores": os.cpu_count(),
            "direction": "every ratio: higher = mmstore better",
            "distinct": distinct(tmp, samples, small, reps),
            "grpo8": grpo8(tmp, 4 * samples, small, reps),
        }
    written = bench_write.run(scale, reps)
    result["write"] = {
        "plain_fsync_over_mmstore": 1 / written["mmstore_over_plain_fsync"],
        "raw": {k: v for k, v in written.items() if k != "encodings"},
    }
    return result


def ratios(figures: dict[str, dict[str, Any]], **pairs: tuple[str, str]) -> dict[str, Any]:
    """Each named ratio of two timings (images/s over images/s: higher = mmstore better) as
    the ratio of their medians, and under ``paired`` as the median of each repetition's."""
    out: dict[str, Any] = {
        name: figures[a]["median"] / figures[b]["median"] for name, (a, b) in pairs.items()
    }
    out["paired"] = {name: paired_ratio(figures, a, b) for name, (a, b) in pairs.items()}
    return out


def table(result: dict[str, Any]) -> str:
    d, g, w = result["distinct"], result["grpo8"], result["write"]
    rows = [
        (
            "loader tv / limit tv, distinct (one fresh loader's pass: start-up included)",
            d,
            "torchvision_over_limit",
            ">= 0.9",
        ),
        (
            f"persistent workers, first of {PASSES} passes / limit tv (start-up included)",
            d,
            "persistent_first_over_limit",
            "",
        ),
        (
            "persistent workers, later passes, image cache off / limit tv (no start-up)",
            d,
            "persistent_later_over_limit",
            ">= 0.8 (issue 43)",
        ),
        (
            "persistent workers, later passes / first pass (image cache off)",
            d,
            "persistent_later_over_first",
            "",
        ),
        (
            "persistent workers, later passes (cache off) / one fresh loader's pass",
            d,
            "persistent_later_over_fresh_loader",
            "",
        ),
        (
            "persistent workers, later passes, caches kept / limit tv (cache hits, not decodes)",
            d,
            "persistent_cached_later_over_limit",
            "",
        ),
        ("loader tv / limit tv with TorchCodec decode", d, "torchvision_over_tensor_limit", ""),
        (
            "loader tv / limit tv with TorchCodec decode, bf16 cast inside",
            d,
            "torchvision_over_cast_inside_limit",
            "",
        ),
        (
            "loader tv / that work in 2 processes at once (measured, not assumed, scaling)",
            d,
            "torchvision_over_limit_at_once",
            "",
        ),
        ("loader tv / naive PIL Dataset", d, "torchvision_over_naive_pil", ">= 1.5"),
        ("loader tv / naive tv Dataset", d, "torchvision_over_naive_torchvision", ">= 1.2"),
        ("loader PIL / limit PIL, distinct", d, "pil_over_limit", ""),
        ("loader PIL / naive PIL Dataset", d, "pil_over_naive_pil", ""),
        ("loader tv / loader PIL", d, "torchvision_over_pil", ""),
        (
            "persistent workers, later passes, cache off / limit tv with TorchCodec decode, "
            "bf16 cast inside (no start-up)",
            d,
            "persistent_later_over_cast_inside_limit",
            ">= 0.9 (issue 43)",
        ),
        (
            "persistent workers, later passes, cache off / that work in 2 processes at once "
            "(no start-up)",
            d,
            "persistent_later_over_limit_at_once",
            "",
        ),
        ("GRPO-8 2x2 loader / limit (start-up included)", g, "over_limit", ">= 6"),
        ("GRPO-8 2x2 loader, each image once / limit", g, "distinct_over_limit", ">= 6"),
        (
            "GRPO-8 2x2 persistent workers, later passes / limit (no start-up)",
            g,
            "steady_over_limit",
            ">= 6 (issue 43)",
        ),
        (
            "GRPO-8 2x2 persistent workers, each image once, later passes / limit (no start-up)",
            g,
            "steady_distinct_over_limit",
            "",
        ),
        (
            "GRPO-8 2x2 loader, each image once, expanded on the CPU / limit",
            g,
            "distinct_expanded_on_cpu_over_limit",
            "",
        ),
        ("GRPO-8 2x2 loader / limit at once", g, "over_limit_at_once", ""),
        ("GRPO-8 each image once / limit at once", g, "distinct_over_limit_at_once", ""),
        ("CPU s/image: limit tv / loader tv, distinct", d, "cpu_limit_over_torchvision", ""),
        (
            f"CPU s/image: limit tv / persistent workers, {PASSES} passes (one start-up), "
            "cache off",
            d,
            "cpu_limit_over_persistent",
            "",
        ),
        ("CPU s/image: limit / GRPO-8 2x2 loader", g, "cpu_limit_over_mmstore", ""),
        ("CPU s/image: limit / GRPO-8 each image once", g, "cpu_limit_over_distinct", ""),
        ("plain+fsync write time / mmstore", w, "plain_fsync_over_mmstore", ">= 0.67"),
    ]

    def paired(section: dict[str, Any], key: str) -> str:
        stats = section.get("paired", {}).get(key)
        return f"{stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f})" if stats else ""

    lines = [
        f"Scale {result['scale']}, {result['reps']} reps, {result['cores']} cores. "
        "Every figure: higher = mmstore better. Value: ratio of the two medians; paired: "
        "median (min-max) of the ratio within each repetition.",
        "",
        "| figure | value | paired | target (issue 14 unless named) |",
        "|---|---|---|---|",
        *(
            f"| {name} | {section[key]:.2f} | {paired(section, key)} | {target} |"
            for name, section, key, target in rows
        ),
        "",
        "Persistent workers, images/s of each pass in order (median over repetitions): "
        + "; ".join(
            f"{name}: "
            + ", ".join(f"{statistics.median(rates):.1f}" for rates in zip(*per_rep, strict=True))
            for name, per_rep in d["persistent_passes_images_per_s"].items()
        ),
        "",
        f"GRPO-8 node cache: {g['distinct_images']} distinct images of {g['images']}; "
        f"per repetition (hits, misses): "
        + "; ".join(
            f"{mode}: " + ", ".join(f"({c['hits']}, {c['misses']})" for c in per_rep)
            for mode, per_rep in g["node_cache_per_rep"].items()
        )
        + f". Persistent workers, images processed in the {PASSES - 1} later passes, per "
        "repetition: "
        + "; ".join(
            f"{mode}: {per_rep}" for mode, per_rep in g["steady_processed_per_rep"].items()
        ),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    cli(run, __doc__, table=table, name="speed")
