"""The epoch plan: which samples of a set of shards each rank reads, and in which order.

A pure function of (seed, epoch, rank, world size, batch) over each shard's usable index entries
(its index minus `Shards.excluded`), so that every rank computes the same split without talking to
the others, a new epoch gets a new order, and a resumed run finds the exact same order again.

Training (`training=True`), after Mosaic streaming's block shuffles (`py1e`/`py1br`):

1. The shards are permuted anew each epoch, from (seed, epoch) alone. Reading shards whole, a
   sample's position follows its shard's, and two independent shard orders are rank-correlated by
   about 1/sqrt(shards) (|Spearman| 0.1 on average at 60 shards, 0.26 in one draw of three): each
   epoch's order is therefore the first draw (from seed, epoch, attempt) whose correlation with the
   previous epoch's is below half that (positions taken within each rank's share: the step at which
   a sample comes, whichever rank reads it), and whose first tenth is expected to share at most 12% with the previous
   first tenth (the best of MAX_DRAWS otherwise). Epoch e's order depends on the orders before it,
   computed once (a few permutations of the shard list each).
2. Their entries, shard after shard in that order, form one sequence of n samples; rank r takes
   the contiguous slice [n*r//world, n*(r+1)//world): disjoint, covering, sizes within one. A
   shard cut by a rank boundary is read by both ranks, each its own entries.
3. Within a rank, the samples of its m shards are spread over a sliding window of WINDOW shards:
   the samples of the j-th shard get uniform random keys in [j + 1/2 - W/2, j + 1/2 + W/2)
   (clipped to [0, m); W = min(WINDOW, m), and the whole of [0, m) when m <= WINDOW), and are
   read in key order. Each batch thus mixes the samples of about W shards, a shard's samples are
   all read while at most W shards are in progress (which bounds the streaming cache), and one
   shard finishes as the next one starts.
4. Each rank keeps the same number of full batches, (n // world) // batch, dropping at most its
   one partial batch, as the file reader does.

Evaluation and prediction (`training=False`): shards in listed order, entries in index order, the
sequence split across ranks contiguously, every sample once (the last batch may be partial).

Why not a shuffle buffer (webdataset's `shardshuffle` + `shuffle(n)`): a buffer's tail keeps a
sample (and its shard) waiting for an unbounded time, so neither the cache nor the order at a
given step has a bound; and the plan here is indexed by position, so DALI's checkpoint (epoch,
iteration) is all a resume needs.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

import numpy as np

WINDOW = 16  # shards whose samples are interleaved at any point of a training epoch
MAX_DRAWS = 200  # shard-order draws per epoch before the best one is taken
FIRST_TENTH_OVERLAP = 0.12  # expected share of the first tenth repeated from the previous epoch (random: 0.10, 90th percentile 0.22)
_ORDERS: dict[tuple, list[np.ndarray]] = {}  # (seed, window, counts) -> shard orders of epochs 0, 1, ...
_ORDERS_LOCK = threading.Lock()


@dataclass(frozen=True)
class Plan:
    """One rank's epoch: sample i is entry `entry[i]` of shard `shard[i]` (positions in Shards)."""
    shard: np.ndarray  # int64, one per sample in reading order
    entry: np.ndarray  # int64: the entry's position in its shard's index file
    batch: int
    batches: int  # batches this rank yields this epoch (the same on every rank)

    def __len__(self) -> int:
        return len(self.shard)

    def valid(self, k: int) -> int:
        """Real samples in batch k (the rest, if any, is padding that the loader drops)."""
        return max(0, min(self.batch, len(self) - k * self.batch))

    @cached_property
    def uses(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(this plan's shards in order of first use, their first positions, their last positions)."""
        if not len(self):
            empty = np.zeros(0, np.int64)
            return empty, empty, empty
        order = np.argsort(self.shard, kind="stable")
        s = self.shard[order]
        starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
        ends = np.r_[starts[1:], len(s)] - 1
        shards, first, last = s[starts], order[starts], order[ends]
        by_first = np.argsort(first, kind="stable")
        return shards[by_first], first[by_first], last[by_first]

    @cached_property
    def spans(self) -> dict[int, tuple[int, int]]:
        """{shard: (first position, last position)} over this plan, in order of first use."""
        return {int(s): (int(a), int(b)) for s, a, b in zip(*self.uses)}

    def in_use(self, sizes, extra: int = 0) -> int:
        """The most bytes of shards this plan has in progress at once (started, not finished),
        with `extra` more positions read ahead; `sizes[shard]` in bytes."""
        shards, first, last = self.uses
        if not len(shards):
            return 0
        size = np.array([sizes[int(s)] or 0 for s in shards], np.int64)
        events = np.r_[first, last + 1 + extra]
        change = np.r_[size, -size]
        order = np.lexsort((change, events))  # at one position, releases before acquisitions
        return int(np.cumsum(change[order]).max())


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) & 0xFFFFFFFF for k in key])


def _positions(order: np.ndarray, counts: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Per shard (indexed by shard): the position of its middle sample within its rank's share (the
    step at which a rank reads it, whichever rank), and that rank."""
    c = counts[order].astype(np.float64)
    n = max(1.0, float(c.sum()))
    mid = np.empty(len(order))
    mid[order] = np.cumsum(c) - c / 2
    rank = np.minimum((mid * world // n).astype(np.int64), world - 1)
    return mid - np.floor(n * rank / world), rank


def _early(order: np.ndarray, counts: np.ndarray, window: int, world: int) -> np.ndarray:
    """Per shard, the expected share of its samples that a plan of this order reads in the first tenth
    of its rank's epoch (its samples spread over `window` of that rank's shard slots, as rule 3 does)."""
    _, rank = _positions(order, counts, world)
    slot = np.empty(len(order))
    slot[order] = np.arange(len(order))
    first = np.full(world, np.inf)
    np.minimum.at(first, rank, slot)
    m = np.bincount(rank, minlength=world)[rank].astype(np.float64)  # the rank's shard count, per shard
    local = slot - first[rank]
    narrow = m > window
    low = np.where(narrow, np.clip(local + 0.5 - window / 2, 0, m), 0.0)
    high = np.where(narrow, np.clip(local + 0.5 + window / 2, 0, m), m)
    return np.clip(np.minimum(high, m / 10) - low, 0, None) / np.maximum(high - low, 1e-9)


def _score(prev: np.ndarray, cand: np.ndarray, counts: np.ndarray, window: int, world: int) -> tuple[float, float]:
    """(|sample-weighted correlation| of the shards' positions within their ranks, expected share of the
    first tenth repeated) between two shard orders."""
    w = counts.astype(np.float64)
    pa, pb = _positions(prev, counts, world)[0], _positions(cand, counts, world)[0]
    a, b = pa - np.average(pa, weights=w), pb - np.average(pb, weights=w)
    den = np.sqrt(np.average(a * a, weights=w) * np.average(b * b, weights=w))
    rho = abs(float(np.average(a * b, weights=w) / den)) if den > 0 else 0.0
    ea, eb = _early(prev, counts, window, world), _early(cand, counts, window, world)
    return rho, float((w * ea * eb).sum() / max(1e-9, (w * ea).sum()))


def shard_order(counts: np.ndarray, seed: int, epoch: int, window: int = WINDOW, world: int = 1) -> np.ndarray:
    """The shard order of a training epoch (see the module docstring, rule 1): the same on every rank."""
    counts = np.asarray(counts, dtype=np.int64)
    with _ORDERS_LOCK:
        return _orders(counts, seed, window, world, epoch)[epoch]


def _orders(counts: np.ndarray, seed: int, window: int, world: int, epoch: int) -> list[np.ndarray]:
    orders = _ORDERS.setdefault((seed, window, world, counts.tobytes()), [])
    limit = 0.5 / np.sqrt(max(1, int((counts > 0).sum())))
    while len(orders) <= epoch:
        e = len(orders)
        best, best_cost = None, None
        for attempt in range(MAX_DRAWS if e else 1):
            cand = _rng(seed, e, 0x5A4D, attempt).permutation(len(counts))
            if not e:
                best = cand
                break
            rho, shared = _score(orders[-1], cand, counts, window, world)
            cost = max(rho / limit, shared / FIRST_TENTH_OVERLAP)
            if best_cost is None or cost < best_cost:
                best, best_cost = cand, cost
            if cost <= 1:
                break
        orders.append(best)
    return orders


def epoch_plan(usable: Sequence[np.ndarray], *, seed: int, epoch: int, rank: int, world: int, batch: int,
               training: bool, window: int = WINDOW) -> Plan:
    """The plan of one rank for one epoch; `usable[s]` lists shard s's usable entry positions in
    index order. See the module docstring for the rules."""
    counts = np.array([len(u) for u in usable], dtype=np.int64)
    n = int(counts.sum())
    shards = shard_order(counts, seed, epoch, window, world) if training else np.arange(len(usable))
    seq_shard = np.repeat(shards, counts[shards])
    seq_entry = (np.concatenate([np.asarray(usable[s], dtype=np.int64) for s in shards]) if n
                 else np.zeros(0, np.int64))
    lo, hi = n * rank // world, n * (rank + 1) // world
    shard, entry = seq_shard[lo:hi], seq_entry[lo:hi]
    if not training:
        most = -(-n // world) if n else 0  # the largest rank's share: every rank yields as many batches
        return Plan(shard, entry, batch, -(-most // batch))
    if len(shard):
        piece = np.cumsum(np.r_[0, shard[1:] != shard[:-1]])  # 0..m-1: the rank's shards in order
        m = int(piece[-1]) + 1
        w = min(window, m)
        if m <= window:
            low, high = np.zeros(m), np.full(m, float(m))
        else:
            centre = np.arange(m) + 0.5
            low, high = np.clip(centre - w / 2, 0, m), np.clip(centre + w / 2, 0, m)
        u = _rng(seed, epoch, rank, world, 0x57).random(len(shard))
        keys = low[piece] + (high[piece] - low[piece]) * u
        order = np.argsort(keys, kind="stable")
        shard, entry = shard[order], entry[order]
    batches = (n // world) // batch
    return Plan(shard[:batches * batch], entry[:batches * batch], batch, batches)
