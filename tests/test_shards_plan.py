"""The epoch plan: ranks disjoint and covering with equal full batches, a new order every epoch that does
not predict the next, a bounded window of shards in use, determinism for exact resume."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dali_pipe.shards import plan as plan_mod
from dali_pipe.shards.plan import WINDOW, epoch_plan


def _usable(counts, excluded=()):
    """Entry positions per shard, minus `excluded` (shard, entry) pairs."""
    ex = set(excluded)
    return [np.array([e for e in range(c) if (s, e) not in ex]) for s, c in enumerate(counts)]


def _samples(p):
    return list(zip(p.shard.tolist(), p.entry.tolist()))


@pytest.mark.parametrize("counts,world,batch", [([50] * 60, 1, 32), ([7, 3, 11, 1, 9], 2, 4), ([41], 2, 5),
                                                ([13, 0, 8, 21], 3, 3), ([5] * 9, 4, 2)])
def test_training_ranks_disjoint_equal_and_drop_at_most_a_partial_batch(counts, world, batch):
    """Every rank: the same number of full batches; together no sample twice; each rank drops at most one batch."""
    usable = _usable(counts, excluded=[(0, 1), (2, 0)])
    n = sum(len(u) for u in usable)
    for epoch in range(3):
        plans = [epoch_plan(usable, seed=4, epoch=epoch, rank=r, world=world, batch=batch, training=True)
                 for r in range(world)]
        assert {p.batches for p in plans} == {(n // world) // batch}
        seen = [s for p in plans for s in _samples(p)]
        assert len(seen) == len(set(seen)) == world * plans[0].batches * batch
        assert all(p.valid(k) == batch for p in plans for k in range(p.batches))
        allowed = {(s, int(e)) for s, u in enumerate(usable) for e in u}
        assert set(seen) <= allowed, "an excluded entry was planned"
        for r, p in enumerate(plans):
            share = n * (r + 1) // world - n * r // world
            assert share - len(p) <= batch


@pytest.mark.parametrize("counts,world,batch", [([7, 3, 11, 1, 9], 2, 4), ([2], 3, 4), ([5, 5], 1, 3)])
def test_evaluation_order_is_listed_order_split_contiguously(counts, world, batch):
    """Non-training: shards in listed order, entries in index order, ranks contiguous; every sample exactly
    once, the same batch count on every rank (the short one marks padding)."""
    usable = _usable(counts, excluded=[(0, 2)])
    plans = [epoch_plan(usable, seed=1, epoch=e, rank=r, world=world, batch=batch, training=False)
             for r in range(world) for e in (0, 3)]
    listed = [(s, int(e)) for s, u in enumerate(usable) for e in u]
    by_rank = [_samples(plans[2 * r]) for r in range(world)]
    assert [x for r in by_rank for x in r] == listed
    assert all(_samples(plans[2 * r]) == _samples(plans[2 * r + 1]) for r in range(world)), "no epoch dependence"
    assert len({p.batches for p in plans}) == 1
    for p in plans:
        assert sum(p.valid(k) for k in range(p.batches)) == len(p)


def test_same_inputs_same_plan_new_epoch_new_order():
    """Deterministic in (seed, epoch, rank, world, batch), whatever was computed before; epochs and seeds differ."""
    usable = _usable([20] * 12)
    kw = dict(rank=0, world=1, batch=8, training=True)
    later = _samples(epoch_plan(usable, seed=3, epoch=5, **kw))
    plan_mod._ORDERS.clear()
    assert _samples(epoch_plan(usable, seed=3, epoch=5, **kw)) == later
    orders = [_samples(epoch_plan(usable, seed=3, epoch=e, **kw)) for e in range(3)]
    assert len({tuple(o) for o in orders}) == 3 and set(orders[0]) == set(orders[1])
    assert orders[0] != _samples(epoch_plan(usable, seed=4, epoch=0, **kw))


def _positions(order):
    return {x: i for i, x in enumerate(order)}


def _spearman(a, b):
    ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
    return abs(float(np.corrcoef(ra, rb)[0, 1]))


@pytest.mark.parametrize("world", [1, 2])
def test_consecutive_epochs_do_not_predict_each_other(world):
    """3000 samples in 60 shards, 6 epochs: the step at which a sample comes (its position on whichever
    rank reads it) in one epoch against the next: |Spearman| < 0.1, first-tenth overlap < 20%."""
    usable = _usable([50] * 60)
    for seed in (0, 1):
        steps = []
        for e in range(6):
            plans = [epoch_plan(usable, seed=seed, epoch=e, rank=r, world=world, batch=32, training=True)
                     for r in range(world)]
            steps.append({x: i for p in plans for i, x in enumerate(_samples(p))})
        for a, b in zip(steps, steps[1:]):
            common = sorted(set(a) & set(b))
            assert _spearman([a[x] for x in common], [b[x] for x in common]) < 0.1
            tenth = len(common) // world // 10
            first = {x for x, i in a.items() if i < tenth}
            assert len(first & {x for x, i in b.items() if i < tenth}) / len(first) < 0.2


def test_a_window_of_shards_in_use_and_batches_mix_them():
    """At any position at most WINDOW shards are started and unfinished; a batch mixes many shards."""
    usable = _usable([50] * 60)
    for world in (1, 2):
        p = epoch_plan(usable, seed=0, epoch=2, rank=world - 1, world=world, batch=32, training=True)
        shards, first, last = p.uses
        live = np.zeros(len(p) + 1, np.int64)
        np.add.at(live, first, 1)
        np.add.at(live, last + 1, -1)
        assert np.cumsum(live).max() <= WINDOW
        assert p.in_use([1] * 60) <= WINDOW
        mix = [len(Counter(p.shard[k * 32:(k + 1) * 32].tolist())) for k in range(p.batches)]
        assert np.median(mix) >= WINDOW // 2
