"""ImageNet-scale start-up at a size CI affords: 100 k hard-linked files (real and hostile ones) in 100 class
folders, read, split, scanned, fingerprinted and resumed on columns, with every guarantee of the small cases.
tools/scale.py measures the same stages at 1 M files next to plain DALI's reader."""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pytest
from helpers import cpu_options

from dali_pipe.config import DataSettings
from dali_pipe.dataset import scan_manifest
from dali_pipe.manifest import read_manifest
from dali_pipe.pipeline import build_pipeline
from dali_pipe.samples import Files
from dali_pipe.spec import ImageSpec

N, CLASSES = 100_000, 100
BAD_HUFFMAN = "corrupt JPEG data"


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """N hard links to the corpus's files (its bad ones included), CLASSES folders, and dataset.tsv."""
    from corpus import make_corpus

    src_root = tmp_path_factory.mktemp("corpus")
    expected = make_corpus(src_root, good_per_class=4)
    sources = sorted(k for k, why in expected.items() if why != BAD_HUFFMAN)  # only --scan full finds it
    root = tmp_path_factory.mktemp("big")
    rows, bad = [], {}
    for c in range(CLASSES):
        (root / f"k{c:03d}").mkdir()
    for i in range(N):
        name = sources[i % len(sources)]
        rel = f"k{i % CLASSES:03d}/{i:06d}{os.path.splitext(name)[1]}"
        os.link(src_root / name, root / rel)
        rows.append(rel)
        if expected[name]:
            bad[str(root / rel)] = expected[name]
    (root / "dataset.tsv").write_text("image_path\n" + "\n".join(rows) + "\n")
    return root, bad, rows


def test_a_hundred_thousand_files_keep_every_guarantee(big, tmp_path):
    root, bad, rows = big
    m = read_manifest(root, val_fraction=0.05, seed=3, skip_missing=False)
    assert len(m.train) + len(m.val) == N and len(m.classes) == CLASSES
    # the split is the rule's: per class, val holds the lowest hashes of sha256("SEED:PATH")
    for c in (0, 57):
        files = rows[c::CLASSES]
        val = {os.path.relpath(p, root.resolve()) for p in m.val.files if f"/k{c:03d}/" in p}
        ranked = sorted(files, key=lambda r: hashlib.sha256(f"3:{r}".encode()).digest()[:8])
        assert val == set(ranked[:len(val)]) and 1 <= len(val) < len(files)
    # the scan's bad-file list, cold (a process per core) then warm (nothing checked)
    data = DataSettings(data=str(root), cache_dir=str(tmp_path / "cache"))
    cold = scan_manifest(m, data, num_threads=1, progress=False)
    assert {p: r for p, r in cold.bad.items()}.keys() == bad.keys()
    assert all(bad[p] in r for p, r in cold.bad.items())
    warm = scan_manifest(read_manifest(root, val_fraction=0.05, seed=3, skip_missing=False), data, num_threads=1,
                         progress=False)
    assert warm.checked == 0 and warm.bad == cold.bad
    # the run's identity: the same data reads to the same digest; one file more changes it
    kept = m.without(cold.bad)
    assert len(kept.train) + len(kept.val) == N - len(bad)
    assert kept.digest() == read_manifest(root, val_fraction=0.05, seed=3, skip_missing=False).without(
        cold.bad).digest()
    # with the cache dir (the checked text and the digest kept): the same split and digest, the second time from it
    for _ in range(2):
        cached = read_manifest(root, val_fraction=0.05, seed=3, skip_missing=False, cache_dir=tmp_path / "cache")
        assert cached.known_digest == m.digest() and cached.val == m.val and cached.train == m.train
    # exact resume of the training order over the whole column
    spec = ImageSpec(32, 32, (0.5,) * 3, (0.5,) * 3)
    source = Files(kept.train.paths, kept.train.labels)
    opts = cpu_options(16, threads=1, training=True, seed=3)
    pipe = build_pipeline(source, spec, opts, training=True)
    pipe.build()
    for _ in range(2):
        pipe.run()
    checkpoint = pipe.checkpoint()
    after = [np.asarray(pipe.run()[1].as_tensor()).ravel().tolist() for _ in range(3)]
    resumed = build_pipeline(source, spec, opts, training=True, checkpoint=checkpoint)
    resumed.build()
    assert [np.asarray(resumed.run()[1].as_tensor()).ravel().tolist() for _ in range(3)] == after

