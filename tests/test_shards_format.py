"""The shard format: keys, labels, index files (checked against DALI's own wds2idx and reader), patterns,
packed.json's checksums."""
import hashlib
import io
import json
import re
import tarfile

import pytest

from dali_pipe.shards.format import (
    FAST_SUM,
    FORMAT,
    KEY_MAX,
    IndexEntry,
    IndexFormatError,
    LabelFormatError,
    PackedFormatError,
    cls_problem,
    file_sums,
    format_index,
    index_tar,
    parse_cls,
    parse_packed,
    read_index,
    sample_keys,
    tar_end,
    tar_member,
)


def test_index_round_trip(tmp_path):
    """format_index then read_index gives the same keys, members, offsets and sizes."""
    entries = [IndexEntry("cat/a", {"jpg": (512, 1000), "cls": (2048, 1)}),
               IndexEntry("dog/b_2", {"jpg": (2560, 7), "cls": (3584, 2)}),
               IndexEntry("odd/my photo 100%", {"seg.png": (4096, 9), "cls": (5120, 1)})]
    path = tmp_path / "s.idx"
    path.write_text(format_index(entries))
    assert read_index(path) == entries
    assert len(path.read_text().splitlines()[3].split()) == 8, "a name with a space stays one token"


@pytest.mark.parametrize("text, where", [("v1.1 1\njpg 0 1 a.jpg\n", "line 1"), ("v1.2 1\njpg 0 1\n", "line 2"),
                                         ("v1.2 2\njpg 0 1 a.jpg\n", "announces 2"),
                                         ("v1.2 1\njpg 100 1 a.jpg\n", "tar block")])
def test_bad_index_named(tmp_path, text, where):
    """A malformed index is an error naming the file and what is wrong."""
    path = tmp_path / "bad.idx"
    path.write_text(text)
    with pytest.raises(IndexFormatError, match=where) as e:
        read_index(path)
    assert "bad.idx" in str(e.value)


def test_parse_cls_plain_padded_and_bad():
    """`.cls` reads webdataset's plain decimal and the zero-padded form; anything else is refused, and the
    forms today's DALI reader cannot parse are named."""
    assert parse_cls(b"7") == 7 and parse_cls(b"000007") == 7 and parse_cls(b"12\n") == 12
    for bad in (b"", b"-1", b"cat", b"1.5"):
        with pytest.raises(LabelFormatError):
            parse_cls(bad)
    assert [cls_problem(x) is None for x in (b"7", b"000007", b"7\n", None, b"cat", b" 7", b"1234567890")] == [
        True, True, True, False, False, False, False]


def test_keys_are_safe_unique_and_traceable():
    """Every name a manifest may hold gets a key of A-Za-z0-9_-/ only, at most KEY_MAX long; names that differ only
    in characters a key cannot hold, or only in their extension, get different keys; a safe name keeps its stem."""
    from corpus import ODD_NAMES

    paths = [f"c/{n.format(i=7)}" for n in ODD_NAMES] + ["a/b.jpg", "a/b.png", "plain/x_1-2.jpg", "p.q/r.s.jpg",
                                                         "deep/" * 30 + "long name.jpg", "c/.hidden.jpg"]
    keys = sample_keys(paths)
    assert len(set(keys.values())) == len(paths)
    assert all(re.fullmatch(r"[A-Za-z0-9_/-]+", k) and len(k) <= KEY_MAX for k in keys.values()), keys
    assert keys["plain/x_1-2.jpg"] == "plain/x_1-2" and keys["c/my photo 7.jpg"].startswith("c/my_photo_7-")
    assert sample_keys(["c/my photo 7.jpg"])["c/my photo 7.jpg"] == keys["c/my photo 7.jpg"], "stable"


def _peer_tar(path, samples):
    import webdataset as wds

    with wds.TarWriter(str(path)) as w:
        for s in samples:
            w.write(s)


def test_index_matches_dalis_own_wds2idx(tmp_path):
    """index_tar writes, for a webdataset-written shard, the very index DALI's wds2idx (shipped in the DALI wheel)
    writes: members grouped by key at the first dot of the last segment, dotted folders, two-dot extensions."""
    import wds2idx

    tar = tmp_path / "s.tar"
    _peer_tar(tar, [{"__key__": "dir.v2/café", "jpg": b"\xff\xd8" * 300, "cls": 1, "seg.png": b"x" * 700},
                    {"__key__": "k2", "jpg": b"y" * 5, "cls": 12, "json": {"label": "dog"}},
                    {"__key__": "k3", "jpeg": b"z" * 1025, "cls": 0}])
    with wds2idx.IndexCreator(str(tar), str(tmp_path / "dali.idx"), verbose=False) as ic:
        ic.create_index()
    with open(tar, "rb") as f:
        ours = index_tar(f)
    assert format_index(ours.entries) == (tmp_path / "dali.idx").read_text()
    assert ours.size == tar.stat().st_size and len(ours.sha256) == 64


def test_dali_reads_every_member_through_our_index_even_with_spaces(tmp_path):
    """DALI's webdataset reader, given our index of a shard whose keys hold spaces (where wds2idx's index breaks
    DALI's parser), yields each sample's bytes as the webdataset library reads them."""
    import numpy as np
    import webdataset as wds
    from nvidia.dali import fn, pipeline_def

    tar, idx = tmp_path / "s.tar", tmp_path / "s.idx"
    _peer_tar(tar, [{"__key__": f"my photo {i}", "jpg": bytes([i]) * (100 + i), "cls": i} for i in range(5)])
    with open(tar, "rb") as f:
        idx.write_text(format_index(index_tar(f).entries))
    assert [e.key for e in read_index(idx)] == [f"my photo {i}" for i in range(5)]

    @pipeline_def(batch_size=5, num_threads=1, device_id=None)
    def read():
        return tuple(fn.readers.webdataset(paths=[str(tar)], index_paths=[str(idx)], ext=["jpg", "cls"]))

    pipe = read()
    pipe.build()
    jpg, cls = pipe.run()
    expected = list(wds.WebDataset(str(tar), shardshuffle=False))
    assert [bytes(np.array(jpg[i])) for i in range(5)] == [s["jpg"] for s in expected]
    assert [bytes(np.array(cls[i])) for i in range(5)] == [s["cls"] for s in expected]


def test_brace_patterns_expand_as_webdataset_does():
    """Shard patterns, nested ones too, expand as braceexpand (webdataset's own expander) expands them; a pattern
    whose braces do not balance is refused naming it."""
    import pytest
    from braceexpand import braceexpand

    from dali_pipe.inputs import detect
    from dali_pipe.shards.listing import expand_braces, is_brace_pattern
    from dali_pipe.shards.shardset import ShardSourceError

    for p in ["s/train-{000000..000012}.tar", "x{1..10}y", "a{01..3}", "{a,b}-{0..2}.tar", "plain.tar", "x{5..1}",
              "s3://b/p/shard-{0000..0003}.tar", "{train/shard-{000000..000002},val/shard-000000}.tar"]:
        assert expand_braces(p) == list(braceexpand(p)), p
    assert is_brace_pattern("{train/shard-{000000..000002},val/shard-000000}.tar") and not is_brace_pattern("x{a}.tar")
    with pytest.raises(ShardSourceError, match=r"'s/x-\{0..3.tar': its braces do not balance"):
        detect("s/x-{0..3.tar").name == "shards" and expand_braces("s/x-{0..3.tar")


def test_index_tar_and_file_sums_give_the_sha256_and_the_xxh3_128_of_the_bytes(tmp_path):
    """The two checksums a shard carries, computed in one pass, against hashlib's sha256 and xxhash's XXH3-128
    of the whole file (the fast checksum a reader of packed.json would compute with the xxhash library)."""
    import xxhash

    tar = tmp_path / "t.tar"
    with tarfile.open(tar, "w", format=tarfile.USTAR_FORMAT) as t:
        for i in range(40):
            data = hashlib.sha512(str(i).encode()).digest() * (i + 1)
            info = tarfile.TarInfo(f"k{i}.bin")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
    raw = tar.read_bytes()
    want = (hashlib.sha256(raw).hexdigest(), xxhash.xxh3_128(raw).hexdigest())
    assert file_sums(tar) == want and FAST_SUM == "xxh3_128"
    with open(tar, "rb") as f:
        indexed = index_tar(f)
    assert (indexed.sha256, indexed.xxh3) == want and indexed.size == len(raw)


@pytest.mark.parametrize("value", ["0" * 31, "g" * 32, "A" * 32, 7, None])
def test_a_malformed_fast_checksum_in_packed_json_is_named(value):
    meta = {"format": FORMAT, "classes": ["a"], "splits": {"train": {"samples": 1, "shards": [
        {"name": "t.tar", "index": "t.idx", "samples": 1, "size": 10, "sha256": "0" * 64, FAST_SUM: value}]}}}
    with pytest.raises(PackedFormatError, match=r"s3://b/p/packed.json: splits.train.shards\[0\]: 'xxh3_128' is "
                                                r"not 32 hexadecimal digits; packed.json was edited or damaged"):
        parse_packed(json.dumps(meta).encode(), "s3://b/p/packed.json")
    del meta["splits"]["train"]["shards"][0][FAST_SUM]  # a pack made before the fast checksum is read as it was
    assert parse_packed(json.dumps(meta).encode(), "x")["splits"]["train"]["shards"][0]["sha256"] == "0" * 64


@pytest.mark.parametrize("sizes", [[0], [1, 511, 512, 513], [10_000, 3, 77] * 7, [10_240 - 3 * 512]])
def test_tar_members_are_the_bytes_tarfile_writes(sizes):
    """A shard written member by member with tar_member and closed with tar_end is, byte for byte, what tarfile
    writes for the same members (ustar, mode 0o644, uid/gid/mtime 0): the pack's writer without tarfile's cost.
    Names up to the 100-byte ustar field (KEY_MAX + '.json') and past it (tarfile's own prefix split)."""
    names = ["a.jpg", "dir/sub/k-0123.cls", "x" * KEY_MAX + ".json", "p" * 60 + "/" + "q" * 70 + ".jpg"]
    members = [(names[i % len(names)].replace(".", f"{i}.", 1), bytes([i % 251]) * n) for i, n in enumerate(sizes)]
    ours = b"".join(tar_member(name, data) for name, data in members)
    ours += tar_end(len(ours))
    expected = io.BytesIO()
    with tarfile.open(fileobj=expected, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), 0, 0o644, 0, 0
            tar.addfile(info, io.BytesIO(data))
    assert ours == expected.getvalue()
    with tarfile.open(fileobj=io.BytesIO(ours)) as tar:
        assert [(m.name, tar.extractfile(m).read()) for m in tar] == members


def test_index_tokens_escape_exactly_what_str_isspace_calls_space():
    """The index's escape test (a regex) and str.isspace agree on every code point."""
    from dali_pipe.shards.format import _NEEDS_ESCAPE

    for code in range(0x110000):
        c = chr(code)
        assert bool(_NEEDS_ESCAPE.search(c)) == (c == "%" or c.isspace()), hex(code)


def test_samples_whose_members_are_not_consecutive_are_found_as_webdataset_would_split_them(photo_root, tmp_path,
                                                                                           monkeypatch):
    """`tar -C DIR -cf x.tar .` stores a folder's files in the order the disk lists them, so a sample's jpg and
    cls may lie apart. webdataset itself then yields each piece as a sample of its own (no image, or no label);
    index_tar names those keys, and reading such shards is refused naming a key and the fix (tar --sort=name);
    the same members sorted read as one sample each."""
    import webdataset as wds

    from dali_pipe.config import DataSettings
    from dali_pipe.inputs import read
    from dali_pipe.shards.shardset import ShardSourceError

    jpegs = sorted(photo_root.rglob("*.jpg"))[:3]
    members = [(f"./k{i}.jpg", p.read_bytes()) for i, p in enumerate(jpegs)]
    members += [(f"./k{i}.cls", str(i % 2).encode()) for i in range(3)]  # as a disk may list them: images first
    for folder, order in (("scattered", members), ("sorted", sorted(members))):
        (tmp_path / folder).mkdir()
        with tarfile.open(tmp_path / folder / "x.tar", "w") as t:
            for name, data in order:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
    theirs = list(wds.WebDataset(str(tmp_path / "scattered" / "x.tar"), shardshuffle=False))
    assert len(theirs) == 6 and not any("jpg" in s and "cls" in s for s in theirs)  # the peer splits them too

    with open(tmp_path / "scattered" / "x.tar", "rb") as f:
        indexed = index_tar(f)
    assert len(indexed.entries) == 6 and indexed.scattered == {"./k0": (0, 3), "./k1": (1, 4), "./k2": (2, 5)}
    with pytest.raises(ShardSourceError) as e:
        read(DataSettings(data=str(tmp_path / "scattered"), cache_dir=str(tmp_path / "cache")))
    assert "x.tar: the members of 3 sample(s) lie in more than one place in the tar" in str(e.value)
    assert "'./k0' (pieces 1 and 4)" in str(e.value) and "tar --sort=name" in str(e.value)

    import dali_pipe.shards.source as source  # an index an earlier version cached (it did not look) is refused too

    with monkeypatch.context() as m:
        m.setattr(source, "find_scattered", lambda keys: {})
        m.setattr("dali_pipe.shards.format.find_scattered", lambda keys: {})
        with pytest.raises(ShardSourceError, match="no sample has a usable image"):  # what it said, the index cached
            read(DataSettings(data=str(tmp_path / "scattered"), cache_dir=str(tmp_path / "old")))
    assert list((tmp_path / "old").rglob("*.idx"))
    with pytest.raises(ShardSourceError, match="lie in more than one place"):
        read(DataSettings(data=str(tmp_path / "scattered"), cache_dir=str(tmp_path / "old"), max_bad_fraction=1.0))

    with open(tmp_path / "sorted" / "x.tar", "rb") as f:
        assert index_tar(f).scattered == {}
    shards = read(DataSettings(data=str(tmp_path / "sorted"), cache_dir=str(tmp_path / "cache"), val_fraction=0.0))
    assert sum(len(s.keys) for s in shards.shards) == 3
