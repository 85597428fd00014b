"""The checked text of dataset.tsv kept between starts: a start that uses it reads the same manifest as one that
does not, the files are looked at again each time, and other bytes, another seed or a damaged cache are only a
slower start."""
from __future__ import annotations

import numpy as np
import pytest

from dali_pipe import listing_cache
from dali_pipe.manifest import ManifestError, Text, read_manifest

pytestmark = pytest.mark.filterwarnings("ignore:.*dropped 2 duplicate row")


def _dataset(root, n=60, extra=""):
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        f = root / f"c{i % 3}" / f"{i:03d}.jpg"
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(b"x" * (i + 1))
        rows.append(f"c{i % 3}/{i:03d}.jpg")
    (root / "dataset.tsv").write_text("image_path\n" + "\n".join(rows + rows[:2]) + "\n" + extra)
    return root


def _read(root, cache, **kw):
    return read_manifest(root, **{"val_fraction": 0.25, "seed": 1, "skip_missing": False, "cache_dir": cache,
                                  "cache_from": 0, **kw})


def _same(a, b):
    for x, y in ((a.train, b.train), (a.val, b.val)):
        assert x.paths.tolist() == y.paths.tolist() and x.labels.tolist() == y.labels.tolist()
        assert x.lines.tolist() == y.lines.tolist() and x.sizes.tolist() == y.sizes.tolist()
        assert x.mtimes.tolist() == y.mtimes.tolist()
    assert (a.classes, a.missing, a.duplicates, a.split_rule, a.digest()) == \
        (b.classes, b.missing, b.duplicates, b.split_rule, b.digest())


def test_a_kept_manifest_reads_as_a_fresh_one_and_the_files_are_looked_at_again(tmp_path, monkeypatch):
    import dali_pipe.manifest as manifest

    root, cache = _dataset(tmp_path / "d"), tmp_path / "cache"
    fresh = read_manifest(root, val_fraction=0.25, seed=1, skip_missing=False)
    first = _read(root, cache)
    assert len(list((cache / listing_cache.FOLDER).glob("*.npz"))) == 1
    _same(first, fresh)
    with monkeypatch.context() as m:  # from the cache: dataset.tsv is not parsed again
        m.setattr(manifest, "read_table", lambda *a: pytest.fail("dataset.tsv parsed despite the cache"))
        _same(_read(root, cache), fresh)
    assert first.duplicates == 2
    (root / "c1" / "004.jpg").write_bytes(b"longer than before")  # a changed file: its new size is seen
    assert 18 in _read(root, cache).train.sizes.tolist() + _read(root, cache).val.sizes.tolist()
    (root / "c0" / "000.jpg").unlink()
    with pytest.raises(ManifestError, match="missing"):
        _read(root, cache)
    _same(_read(root, cache, skip_missing=True), read_manifest(root, val_fraction=0.25, seed=1, skip_missing=True))
    (root / "c0" / "000.jpg").mkdir()  # a file become a folder
    with pytest.raises(ManifestError, match="is a directory"):
        _read(root, cache)


def test_other_bytes_another_seed_or_a_damaged_cache_read_afresh(tmp_path):
    root, cache = _dataset(tmp_path / "d"), tmp_path / "cache"
    _read(root, cache)
    (kept,) = (cache / listing_cache.FOLDER).glob("*.npz")
    (digest,) = (cache / listing_cache.FOLDER).glob("*.digest.json")
    other_key = digest.read_text().replace('"key": "', '"key": "x').replace('"digest": "', '"digest": "0')
    for junk in ("", "[]", '{"key": 1}', other_key):  # a damaged digest file, or one kept for other inputs
        digest.write_text(junk)
        _same(_read(root, cache), read_manifest(root, val_fraction=0.25, seed=1, skip_missing=False))
    for seed in (2, 1):
        _same(_read(root, cache, seed=seed), read_manifest(root, val_fraction=0.25, seed=seed, skip_missing=False))
    _dataset(root, n=90)  # more rows: other bytes
    assert len(_read(root, cache).train) + len(_read(root, cache).val) == 90
    for junk in (b"", b"not a zip", kept.read_bytes()[:500]):
        kept.write_bytes(junk)
        _same(_read(root, cache), read_manifest(root, val_fraction=0.25, seed=1, skip_missing=False))
    text = listing_cache.load_text(kept, text_key(root).decode(), Text)
    assert text is not None and len(text.rel) == 90 and text.units is not None
    np.savez(kept, meta=np.frombuffer(b'{"format": 1, "key": "%s", "labels": 9, "folders": 1, "duplicates": 0}'
                                      % text_key(root), dtype=np.uint8))
    _same(_read(root, cache), read_manifest(root, val_fraction=0.25, seed=1, skip_missing=False))


def text_key(root) -> bytes:
    return listing_cache.cache_key((root / "dataset.tsv").read_bytes(), root).encode()


def test_bad_rows_are_refused_every_time_and_nothing_is_kept_for_them(tmp_path):
    root, cache = _dataset(tmp_path / "d", extra="../outside.jpg\n"), tmp_path / "cache"
    for _ in range(2):
        with pytest.raises(ManifestError, match="escapes the dataset root"):
            _read(root, cache)
    assert not (cache / listing_cache.FOLDER).exists()


def test_small_manifests_are_not_kept(tmp_path):
    root, cache = _dataset(tmp_path / "d"), tmp_path / "cache"
    _read(root, cache, cache_from=1000)
    assert not (cache / listing_cache.FOLDER).exists()


def _digest_now(m):
    """The digest computed from the columns, not the kept one."""
    import dataclasses

    return dataclasses.replace(m, known_digest=None).digest()


def test_the_kept_digest_is_the_computed_one_and_follows_a_relinked_folder_the_split_and_missing_files(tmp_path):
    """A manifest read with the cache dir carries the digest kept for its text, split settings and resolved folders:
    equal to the one computed from its columns; a class folder linked elsewhere (the same names, other files), other
    split settings and a missing file each give the digest of what is read now, never the kept one."""
    import os
    import shutil

    root, cache = _dataset(tmp_path / "d"), tmp_path / "cache"
    first = _read(root, cache)
    assert first.known_digest is not None and first.known_digest == _digest_now(first)
    again = _read(root, cache)
    assert again.known_digest == first.known_digest == _digest_now(again)
    other = _read(root, cache, seed=2)  # other split settings: its own digest, kept in turn
    assert other.digest() == _digest_now(other) != first.digest()
    assert _read(root, cache).digest() == first.digest()

    shutil.move(root / "c2", tmp_path / "real-c2")  # c2 becomes a link to a folder elsewhere: the paths change
    os.symlink(tmp_path / "real-c2", root / "c2")
    linked = _read(root, cache)
    assert linked.digest() == _digest_now(linked) != first.digest()
    (tmp_path / "real-c2b").mkdir()
    for f in (tmp_path / "real-c2").iterdir():
        shutil.copy(f, tmp_path / "real-c2b" / f.name)
    os.unlink(root / "c2")
    os.symlink(tmp_path / "real-c2b", root / "c2")  # the same link, pointing elsewhere
    relinked = _read(root, cache)
    assert relinked.digest() == _digest_now(relinked) != linked.digest()

    (root / "c0" / "000.jpg").unlink()  # a missing file: nothing kept is used
    short = _read(root, cache, skip_missing=True)
    assert short.known_digest is None and short.digest() != relinked.digest()
    assert short.without({str(short.train.paths[0])}).known_digest is None
    assert relinked.without(set()).known_digest == relinked.known_digest  # (the scan found nothing bad)
    assert relinked.without({str(relinked.train.paths[0])}).known_digest is None


def test_the_text_kept_is_that_of_the_bytes_its_key_was_made_of_and_a_kept_digest_must_look_like_one(
        tmp_path, monkeypatch):
    """dataset.tsv rewritten between the read that makes the key and the parse: what is kept under the key is the
    parse of those first bytes (before: of the new file's, so the old bytes later read as the new rows, with their
    digest). A kept digest of the right key that is no 16 hex digits ('', a word) is computed again."""
    import json

    import dali_pipe.manifest as manifest

    root, cache = _dataset(tmp_path / "d"), tmp_path / "cache"
    old = (root / "dataset.tsv").read_bytes()
    parse = manifest.read_table

    def rewritten_meanwhile(tsv, raw=None):
        _dataset(root, n=90)
        return parse(tsv, raw)

    monkeypatch.setattr(manifest, "read_table", rewritten_meanwhile)
    _read(root, cache)
    monkeypatch.setattr(manifest, "read_table", parse)
    (root / "dataset.tsv").write_bytes(old)
    _same(_read(root, cache), read_manifest(root, val_fraction=0.25, seed=1, skip_missing=False))

    (digest,) = (cache / listing_cache.FOLDER).glob("*.digest.json")
    kept = json.loads(digest.read_text())
    for bad in ("", "not hex at all!", kept["digest"].upper()):
        digest.write_text(json.dumps({**kept, "digest": bad}))
        m = _read(root, cache)
        assert m.digest() == _digest_now(m)
