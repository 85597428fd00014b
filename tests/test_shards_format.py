"""The shard format's index files: DALI v1.2, written and read back."""
import pytest

from dali_pipe.shards.format import IndexEntry, IndexFormatError, LabelFormatError, format_index, parse_cls, read_index


def test_index_round_trip(tmp_path):
    """format_index then read_index gives the same keys, members, offsets and sizes."""
    entries = [IndexEntry("cat/a", {"jpg": (512, 1000), "cls": (2048, 1)}),
               IndexEntry("dog/b_2", {"jpg": (2560, 7), "cls": (3584, 2)})]
    path = tmp_path / "s.idx"
    path.write_text(format_index(entries))
    assert read_index(path) == entries


@pytest.mark.parametrize("text, where", [("v1.1 1\njpg 0 1 a.jpg\n", "line 1"), ("v1.2 1\njpg 0 1\n", "line 2"),
                                         ("v1.2 2\njpg 0 1 a.jpg\n", "announces 2")])
def test_bad_index_named(tmp_path, text, where):
    """A malformed index is an error naming the file and what is wrong."""
    path = tmp_path / "bad.idx"
    path.write_text(text)
    with pytest.raises(IndexFormatError, match=where) as e:
        read_index(path)
    assert "bad.idx" in str(e.value)


def test_parse_cls_plain_padded_and_bad():
    """`.cls` reads webdataset's plain decimal and the zero-padded form; anything else is refused."""
    assert parse_cls(b"7") == 7 and parse_cls(b"000007") == 7 and parse_cls(b"12\n") == 12
    for bad in (b"", b"-1", b"cat", b"1.5"):
        with pytest.raises(LabelFormatError):
            parse_cls(bad)
