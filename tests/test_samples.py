"""Samples as columns: selection, joining and iteration agree with the list of Sample they stand for."""
from __future__ import annotations

import numpy as np

from dali_pipe.samples import STRINGS, Sample, Samples, strings, unique_inverse


def _some(n=6):
    return [Sample(f"/d/c{i % 2}/{i}.jpg", i % 2, i + 2) for i in range(n)]


def test_columns_hold_what_the_samples_say():
    listed = _some()
    s = Samples.of(listed)
    assert s.paths.dtype == STRINGS and s.labels.dtype == np.int32 and len(s) == 6 and s
    assert list(s) == listed and s == listed and s[3] == listed[3]
    assert s.take([4, 1]) == [listed[4], listed[1]] and s[1:3] == listed[1:3]
    assert s.take(s.labels == 1) == [x for x in listed if x.label == 1]
    assert (s + s.take([0])) == listed + [listed[0]] and (s + []) == listed
    assert s.without({listed[2].path, "/not/there.jpg"}) == listed[:2] + listed[3:]
    assert s.without([]) is s and s.files == [x.path for x in listed]
    assert not Samples([], []) and Samples([], []) == []
    assert (s.sizes == -1).all() and (s.mtimes == -1).all()


def test_names_that_are_not_utf8_fall_back_to_an_object_column():
    """A file name whose bytes are not UTF-8 (Python holds it with surrogate escapes) is kept exactly."""
    odd = "/d/c0/caf\udce9.jpg"
    s = Samples([odd, "/d/c1/b.jpg"], [0, 1])
    assert s.paths.dtype == object and s[0].path == odd
    joined = s + Samples.of(_some(2))
    assert joined.paths.dtype == object and joined[0].path == odd and len(joined) == 4
    assert s.without([odd]) == [Sample("/d/c1/b.jpg", 1, 0)]


def test_unique_inverse_holds_where_numpys_default_sort_of_text_crashes():
    """1000 class names repeated in turn (2000 paths in 1000 folders, listed in turn) sent np.unique's default
    sort into numpy 2.4's StringDType heapsort, which crashed the process (SIGSEGV) before the first batch."""
    names = [f"c{i % 1000:04d}" for i in range(2000)]
    for column in (strings(names), strings(names[::-1]), np.array(names, dtype=object)):
        got, inverse = unique_inverse(column)
        want, want_inverse = np.unique(np.array(names if column[0] == "c0000" else names[::-1]), return_inverse=True)
        assert got.tolist() == want.tolist() and inverse.tolist() == want_inverse.tolist()
    assert [x.tolist() for x in unique_inverse(strings([]))] == [[], []]
