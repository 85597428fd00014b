"""Epoch exactness of the DALI loader and the DataModule: len() batches, each sample once."""
from __future__ import annotations

from collections import Counter

import pytest
from helpers import cpu_options

from dali_pipe.loader import DaliLoader
from dali_pipe.pipeline import build_pipeline
from dali_pipe.spec import ImageSpec

SPEC = ImageSpec(16, 16, (0.5,) * 3, (0.5,) * 3)


def _indexed(photo_root):
    """All files with label = their own index, so a batch says exactly which samples it holds."""
    from dali_pipe.manifest import read_manifest

    m = read_manifest(photo_root, val_fraction=0, seed=0, skip_missing=False)
    files = [s.path for s in m.train]
    return files, list(range(len(files)))


def _loader(files, labels, batch, training, shard=0, shards=1):
    opts = cpu_options(batch, threads=2, training=training, shard_id=shard, num_shards=shards, seed=3)
    return DaliLoader(build_pipeline(files, labels, SPEC, opts, training=training), training=training)


@pytest.mark.parametrize("batch", [5, 7, 48, 64])
def test_validation_sees_every_sample_once_per_epoch(photo_root, batch):
    files, labels = _indexed(photo_root)  # 48 files
    loader = _loader(files, labels, batch, training=False)
    for _ in range(3):
        seen = [int(x) for _, y in loader for x in y]
        assert sorted(seen) == labels
    assert len(loader) == -(-48 // batch)


def test_training_epochs_are_exact_and_drop_only_the_partial_batch(photo_root):
    """3 epochs: len() batches each, no sample twice, fewer than one batch dropped, order reshuffled."""
    files, labels = _indexed(photo_root)
    loader = _loader(files, labels, 7, training=True)
    assert len(loader) == 48 // 7
    orders = []
    for _ in range(3):
        batches = [y.tolist() for x, y in loader]
        assert len(batches) == len(loader)
        seen = [i for b in batches for i in b]
        assert max(Counter(seen).values()) == 1 and 48 - len(seen) < 7
        orders.append(seen)
    assert orders[0] != orders[1]


def test_abandoned_epoch_does_not_leak_into_the_next(photo_root):
    """Lightning may stop mid-epoch (sanity check, max_steps): the next iter() is still a full epoch."""
    files, labels = _indexed(photo_root)
    loader = _loader(files, labels, 5, training=False)
    it = iter(loader)
    next(it), next(it)
    del it
    seen = [int(x) for _, y in loader for x in y]
    assert sorted(seen) == labels


def test_shards_partition_the_data(photo_root):
    """2 shards: disjoint, same batch count, together everything but < 1 batch per shard."""
    files, labels = _indexed(photo_root)
    loaders = [_loader(files, labels, 5, training=True, shard=r, shards=2) for r in range(2)]
    for _ in range(2):
        per_rank = [[int(x) for _, y in ld for x in y] for ld in loaders]
        assert len(per_rank[0]) == len(per_rank[1]) == len(loaders[0]) * 5
        both = per_rank[0] + per_rank[1]
        assert max(Counter(both).values()) == 1
        assert 48 - len(both) < 2 * 5


@pytest.mark.parametrize("n,batch", [(41, 5), (43, 10), (21, 10), (40, 4)])
def test_uneven_shards_same_batch_count_no_duplicates(photo_root, n, batch):
    """Shards of unequal size: every rank runs the same number of full batches for 4 epochs, no
    sample twice in an epoch, and each rank drops at most its one partial batch."""
    files, labels = _indexed(photo_root)
    files, labels = files[:n], labels[:n]
    loaders = [_loader(files, labels, batch, training=True, shard=r, shards=2) for r in range(2)]
    assert len(loaders[0]) == len(loaders[1]) == (n // 2) // batch
    for _ in range(4):
        per_rank = [[int(x) for _, y in ld for x in y] for ld in loaders]
        both = per_rank[0] + per_rank[1]
        assert max(Counter(both).values()) == 1
        for r, seen in enumerate(per_rank):
            shard = (n * (r + 1)) // 2 - (n * r) // 2
            assert len(seen) == len(loaders[0]) * batch and shard - len(seen) <= batch
