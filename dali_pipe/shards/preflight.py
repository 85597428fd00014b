"""A streamed pack's --stream-cache checked before torch and Lightning load: from packed.json alone (one GET),
the epoch plans of every rank's training and validation readers, by the stream cache's own rule (cache.least);
`train.py` calls it first (cli.stream_refusal), so a cache too small is told in well under a second instead of
15-17 s in, once the index files are local. Its own module: the plan takes numpy, which a pack's sync never
loads."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..s3 import local_target
from ..sync import read_object
from .cache import least, reader_need, stream_bound, stream_folder, too_small
from .format import PACKED_NAME, parse_packed
from .packs import has_local_copy
from .packsync import auto_mode, room
from .plan import epoch_plan


def stream_preflight(data: str, cache_dir: str | Path, *, mode: str, stream_cache: int | None, batch: int,
                     seed: int, world: int, local_ranks: int) -> None:
    """Before torch loads: refuse a --stream-cache (or a disk) too small to stream the pack at the s3:// prefix
    `data`, with the size that is enough, from its packed.json alone (one GET): the epoch plans of every rank's
    training and validation readers, as the stream cache computes them once the index files are local
    (cache.least; the same numbers where no sample is excluded, as in a pack). Nothing when the prefix holds no
    pack or its shards will be synced."""
    if mode == "sync":
        return
    raw = read_object(data, PACKED_NAME)
    if raw is None:
        return
    meta = parse_packed(raw, f"{data}/{PACKED_NAME}")
    shards = [s for split in meta["splits"].values() for s in split["shards"]]
    local = local_target(data, Path(cache_dir))
    if mode == "auto" and auto_mode(*room(shards, local)) == "sync":
        return
    # a shard an earlier sync left whole in the pack's local copy is read from there, and the stream cache counts
    # it as nothing; a split without a streamed shard registers no reader
    sizes = {s["name"]: 0 if has_local_copy(local, s) else s["size"] for s in shards}
    splits = [(info["shards"], name == "train") for name, info in meta["splits"].items()
              if name in ("train", "val") and any(sizes[s["name"]] for s in info["shards"])]
    if not splits:
        return
    largest = max(sizes[s["name"]] for split, _ in splits for s in split)
    readers = [([np.arange(s["samples"]) for s in split], [sizes[s["name"]] for s in split], training)
               for split, training in splits]
    needs = [sum(reader_need(lambda e: epoch_plan(usable, seed=seed, epoch=e, rank=rank, world=world, batch=batch,
                                                  training=training), split_sizes, batch)
                 for usable, split_sizes, training in readers) for rank in range(world)]
    folder = stream_folder(data, cache_dir) / "rank-0"
    refusal = too_small(stream_bound(stream_cache, folder, local_ranks), least([max(needs, default=0)], largest,
                                                                              local_ranks), largest, folder, local_ranks)
    if refusal is not None:
        raise refusal
