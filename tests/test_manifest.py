"""dataset.tsv parsing: labels, splits, and an error naming the row/column for each bad case."""
from __future__ import annotations

import numpy as np
import pytest

from dali_pipe.manifest import ManifestError, stratified_split
from dali_pipe.manifest import read_manifest as _read_manifest


def read_manifest(root, **kw):
    """read_manifest with the settings' defaults unless the test says otherwise."""
    return _read_manifest(root, **{"val_fraction": 0.1, "seed": 0, "skip_missing": False, **kw})


def _write(root, text: str, files=(), raw: bytes | None = None):
    root.mkdir(parents=True, exist_ok=True)
    for f in files:
        (root / f).parent.mkdir(parents=True, exist_ok=True)
        (root / f).write_bytes(b"x")
    (root / "dataset.tsv").write_bytes(raw if raw is not None else text.encode())
    return root


FILES = ["cat/a.jpg", "cat/b.jpg", "cat/c.jpg", "dog/a.jpg", "dog/b.jpg", "dog/c.jpg"]


def test_label_from_parent_folder_and_sorted_classes(tmp_path):
    """Without a label column the class is the parent folder; classes are sorted."""
    root = _write(tmp_path / "d", "image_path\n" + "\n".join(reversed(FILES)) + "\n", FILES)
    m = read_manifest(root, val_fraction=0.0)
    assert m.classes == ["cat", "dog"]
    assert sorted((s.path.split("/")[-2], s.label) for s in m.train) == sorted(
        [("cat", 0)] * 3 + [("dog", 1)] * 3)
    assert m.val == []


def test_a_thousand_classes_listed_in_turn_read(tmp_path):
    """2000 files in 1000 class folders, listed in turn (c0000, c0001, ..., c0999, c0000, ...), as a script writes
    them: numpy's default sort of the labels crashed the process here (SIGSEGV, no message)."""
    files = [f"c{i % 1000:04d}/{i:05d}.jpg" for i in range(2000)]
    m = read_manifest(_write(tmp_path / "d", "image_path\n" + "\n".join(files) + "\n", files))
    assert m.classes == [f"c{i:04d}" for i in range(1000)]
    assert sorted((s.path.rsplit("/", 2)[-2], s.label) for s in m.train + m.val) == sorted(
        (f.split("/")[0], int(f[1:5])) for f in files)


def test_label_column_overrides_folder(tmp_path):
    """An explicit label wins over the folder name."""
    text = "image_path\tlabel\n" + "".join(f"{f}\t{'x' if i % 2 else 'y'}\n" for i, f in enumerate(FILES))
    m = read_manifest(_write(tmp_path / "d", text, FILES), val_fraction=0.0)
    assert m.classes == ["x", "y"]


def test_split_column_is_used(tmp_path):
    text = "image_path\tsplit\n" + "".join(f"{f}\t{'val' if f.endswith('a.jpg') else 'train'}\n" for f in FILES)
    m = read_manifest(_write(tmp_path / "d", text, FILES))
    assert sorted(s.path.split("/")[-1] for s in m.val) == ["a.jpg", "a.jpg"]
    assert len(m.train) == 4


def test_stratified_split_is_deterministic_and_per_class(tmp_path):
    """Same seed, same split; every class gets val rows; a different seed changes it; about the fraction."""
    files = [f"c{c}/{i}.jpg" for c in range(3) for i in range(20)]
    root = _write(tmp_path / "d", "image_path\n" + "\n".join(files), files)
    a = read_manifest(root, val_fraction=0.2, seed=1)
    b = read_manifest(root, val_fraction=0.2, seed=1)
    c = read_manifest(root, val_fraction=0.2, seed=2)
    assert [s.path for s in a.val] == [s.path for s in b.val]
    assert {s.path for s in a.val} != {s.path for s in c.val}
    assert sorted({s.label for s in a.val}) == [0, 1, 2]
    assert 6 <= len(a.val) <= 20 and len(a.val) + len(a.train) == 60
    assert not {s.path for s in a.val} & {s.path for s in a.train}


def test_split_stays_put_as_images_are_added(tmp_path):
    """Adding images never moves the existing ones between train and val."""
    files = [f"c{c}/{i}.jpg" for c in range(2) for i in range(30)]
    root = _write(tmp_path / "d", "image_path\n" + "\n".join(files), files)
    before = {s.path: "val" for s in read_manifest(root, val_fraction=0.2).val}
    more = files + [f"c{c}/new{i}.jpg" for c in range(2) for i in range(15)]
    _write(root, "image_path\n" + "\n".join(more), more)
    after = read_manifest(root, val_fraction=0.2)
    val_after = {s.path for s in after.val}
    assert set(before) <= val_after and not set(before) & {s.path for s in after.train}


def test_equal_split_hashes_in_a_class_are_ordered_by_path():
    """The split orders a class by hash, then path: where two hashes are equal (given here), the path decides."""
    from dali_pipe.samples import Samples

    samples = Samples(["/d/b.jpg", "/d/a.jpg", "/d/c.jpg", "/d/d.jpg"], [0, 0, 0, 0])
    train, val = stratified_split(samples, 0.3, 0, units=np.array([0.5, 0.5, 0.1, 0.9]))
    assert val.paths.tolist() == ["/d/c.jpg"] and train.paths.tolist() == ["/d/a.jpg", "/d/b.jpg", "/d/d.jpg"]


def test_stratified_split_keeps_small_classes_in_both_splits():
    from dali_pipe.manifest import Sample

    samples = {f"{c}/{i}.jpg": Sample(f"/x/{c}{i}", c, 2) for c in range(2) for i in range(2)}
    train, val = stratified_split(samples, 0.9, 0)
    assert len(train) == 2 and len(val) == 2
    train, val = stratified_split(samples, 0.01, 0)
    assert len(train) == 2 and len(val) == 2


def test_headers_are_case_insensitive_and_typos_are_named(tmp_path):
    files = ["cat/a.jpg", "dog/a.jpg", "cat/b.jpg", "dog/b.jpg"]
    text = " Image_Path \tLABEL\tSplit\n" + "".join(f"{f}\t{f[:3]}x\t{'val' if 'b' in f else 'train'}\n" for f in files)
    m = read_manifest(_write(tmp_path / "d", text, files))
    assert m.classes == ["catx", "dogx"] and len(m.val) == 2
    with pytest.raises(ManifestError, match=r"e/dataset.tsv: line 1: column 'lable' looks like a typo of 'label'"):
        read_manifest(_write(tmp_path / "e", "image_path\tlable\n" + "".join(f"{f}\tq\n" for f in files), files))


@pytest.mark.parametrize("header,needle", [
    ("imagepath", r"line 1: column 'imagepath' looks like a typo of 'image_path'; rename it"),
    ("Image Path\tlable", r"line 1: column 'image path' looks like a typo of 'image_path'; column 'lable' looks "
                          r"like a typo of 'label'; rename them"),
    ("image_path,label", r"line 1: the header 'image_path,label' is comma-separated: this is a CSV file, and "
                         r"dataset.tsv is tab-separated"),
    ("image_path;label", r"line 1: the header 'image_path;label' is semicolon-separated"),
])
def test_a_misspelt_or_comma_separated_header_is_named(tmp_path, header, needle):
    """A header that misses image_path says what it looks like: a typo of which column, or a CSV file."""
    sep = "," if "," in header else ";" if ";" in header else "\t"
    body = "".join(f"{f}{sep}{f[:3]}\n" if sep in header else f"{f}\n" for f in FILES)
    with pytest.raises(ManifestError, match=needle):
        read_manifest(_write(tmp_path / "d", f"{header}\n{body}", FILES))


def test_a_split_column_without_train_rows_says_what_helps(tmp_path):
    """All rows val: the way out is split=train rows (--val-fraction does not apply with a split column)."""
    root = _write(tmp_path / "d", "image_path\tsplit\n" + "".join(f"{f}\tval\n" for f in FILES), FILES)
    with pytest.raises(ManifestError, match=r"the 'split' column marks no row train \(all 6 say val, lines 2 to 7\): "
                                            r"mark the rows to train on split=train") as e:
        read_manifest(root)
    assert "lower --val-fraction" not in str(e.value)


def test_validation_is_a_split_value(tmp_path):
    """'validation' (as Hugging Face names the split) means val."""
    text = "image_path\tsplit\n" + "".join(f"{f}\t{'Validation' if 'a.' in f else 'train'}\n" for f in FILES)
    m = read_manifest(_write(tmp_path / "d", text, FILES))
    assert len(m.val) == 2 and len(m.train) == 4


def test_extra_fields_name_the_line_and_trailing_tabs_are_padding(tmp_path):
    """A row with more fields than the header is named (pandas took the first column as an index when the
    first row had one more, shifting every value silently); empty trailing fields are padding."""
    text = "image_path\tlabel\ncat/a.jpg\tcat\tEXTRA\n" + "".join(f"{f}\t{f[:3]}\t\n" for f in FILES[1:])
    with pytest.raises(ManifestError, match=r"line 2 has 3 tab-separated fields, the header 2 \(image_path, label\)"):
        read_manifest(_write(tmp_path / "d", text, FILES))
    text = "image_path\tlabel\n" + "".join(f"{f}\t{f[:3]}\t\t\n" for f in FILES)
    assert read_manifest(_write(tmp_path / "e", text, FILES), val_fraction=0).classes == ["cat", "dog"]


def test_bytes_that_are_not_utf8_name_the_line(tmp_path):
    raw = b"image_path\ncat/a.jpg\ndog/\xff.jpg\n"
    with pytest.raises(ManifestError, match=r"line 3: not UTF-8 text"):
        read_manifest(_write(tmp_path / "d", "", FILES, raw=raw))


def test_empty_label_in_a_labelled_manifest_names_the_line(tmp_path):
    files = ["cat/a.jpg", "dog/a.jpg", "dog/b.jpg"]
    text = "image_path\tlabel\ncat/a.jpg\tcat\ndog/a.jpg\t\ndog/b.jpg\tdog\n"
    with pytest.raises(ManifestError, match=r"line 3: 'dog/a.jpg' has an empty label"):
        read_manifest(_write(tmp_path / "d", text, files))


def test_integer_labels_sort_numerically(tmp_path):
    files = [f"x/{i}.jpg" for i in range(4)]
    text = "image_path\tlabel\n" + "".join(f"{f}\t{lab}\n" for f, lab in zip(files, ["10", "2", "1", "2"]))
    assert read_manifest(_write(tmp_path / "d", text, files), val_fraction=0).classes == ["1", "2", "10"]


def test_a_directory_row_is_named_as_such(tmp_path):
    root = _write(tmp_path / "d", "image_path\ncat/a.jpg\ndog\n", ["cat/a.jpg", "dog/a.jpg"])
    with pytest.raises(ManifestError, match=r"line 3: 'dog' is a directory"):
        read_manifest(root)


@pytest.mark.parametrize("text,files,needle", [
    ("path\tlabel\ncat/a.jpg\tcat\n", ["cat/a.jpg"], "no 'image_path' column"),
    ("image_path\n", [], "no rows"),
    ("image_path\ncat/a.jpg\ncat/b.jpg\n", ["cat/a.jpg", "cat/b.jpg"], "at least two"),
    ("image_path\ncat/a.jpg\ndog/zzz.jpg\n", ["cat/a.jpg"], "missing"),
    ("image_path\ncat/a.jpg\n../escape.jpg\n", ["cat/a.jpg"], "line 3"),
    ("image_path\ncat/a.jpg\n/etc/passwd\n", ["cat/a.jpg"], "outside the dataset root"),
    ("image_path\ncat/a.jpg\nloose.jpg\n", ["cat/a.jpg", "loose.jpg"], "no class folder"),
    ("image_path\tsplit\ncat/a.jpg\ttrain\ndog/a.jpg\ttest\n", ["cat/a.jpg", "dog/a.jpg"],
     r"line 3: split 'test' is not one of train, val \(or validation\)"),
])
def test_errors_name_the_problem(tmp_path, text, files, needle):
    """Each bad manifest gets a ManifestError that says what is wrong and where."""
    with pytest.raises(ManifestError, match=needle):
        read_manifest(_write(tmp_path / "d", text, files))


def test_missing_files_listed_with_count_and_skippable(tmp_path):
    files = ["cat/a.jpg", "dog/a.jpg"]
    listed = files + [f"dog/m{i}.jpg" for i in range(7)]
    root = _write(tmp_path / "d", "image_path\n" + "\n".join(listed), files)
    with pytest.raises(ManifestError) as e:
        read_manifest(root)
    assert "7 listed file(s) missing" in str(e.value) and "2 more" in str(e.value) and "--skip-missing" in str(e.value)
    m = read_manifest(root, skip_missing=True, val_fraction=0)
    assert len(m.train) == 2 and len(m.missing) == 7


def test_hostile_formatting_is_tolerated(tmp_path):
    """BOM, CRLF, padding spaces, blank lines, extra columns, unicode and spaces in paths."""
    files = ["chat noir/été 1.jpg", "chat noir/b.jpg", "dog/a.jpg", "dog/b.jpg"]
    text = ("\ufeffimage_path \t extra\r\n"
            " chat noir/été 1.jpg \tfoo\r\n\r\n"
            "chat noir/b.jpg\tbar\r\n"
            "   \t  \r\n"
            "dog/a.jpg\t\r\n"
            "dog/b.jpg\tbaz\r\n")
    m = read_manifest(_write(tmp_path / "d", "", files, raw=text.encode("utf-8")), val_fraction=0)
    assert m.classes == ["chat noir", "dog"]
    assert any(s.path.endswith("été 1.jpg") for s in m.train)


def test_duplicate_rows_warn_and_dedupe(tmp_path):
    files = ["cat/a.jpg", "dog/a.jpg"]
    root = _write(tmp_path / "d", "image_path\ncat/a.jpg\ncat/a.jpg\ndog/a.jpg\n", files)
    with pytest.warns(UserWarning, match="1 duplicate"):
        m = read_manifest(root, val_fraction=0)
    assert len(m.train) == 2 and m.duplicates == 1


def test_conflicting_duplicate_is_refused(tmp_path):
    files = ["cat/a.jpg", "dog/a.jpg"]
    root = _write(tmp_path / "d", "image_path\tlabel\ncat/a.jpg\tcat\ncat/a.jpg\tdog\ndog/a.jpg\tdog\n", files)
    with pytest.raises(ManifestError, match="line 3.*repeats line 2"):
        read_manifest(root)


def test_absolute_path_inside_root_is_allowed(tmp_path):
    root = _write(tmp_path / "d", "", ["cat/a.jpg", "dog/a.jpg"])
    (root / "dataset.tsv").write_text(f"image_path\n{root.resolve()}/cat/a.jpg\ndog/a.jpg\n")
    assert len(read_manifest(root, val_fraction=0).train) == 2


def test_escape_is_refused_without_opening(tmp_path):
    """A '../' row is refused lexically: the file outside the root is never looked at."""
    outside = tmp_path / "secret.jpg"
    outside.write_bytes(b"x")
    root = _write(tmp_path / "d", "image_path\ncat/a.jpg\ndog/a.jpg\n../secret.jpg\n", ["cat/a.jpg", "dog/a.jpg"])
    with pytest.raises(ManifestError, match="escapes the dataset root"):
        read_manifest(root)


def test_paths_resolve_as_pathlib_does_with_one_lstat_a_file(tmp_path):
    """PathResolver gives each row the path Path.resolve(strict=True) gives (the link itself where that fails):
    plain files, files in a linked folder, a root reached through a link, a linked file, a dangling link and
    a link loop; a link to a folder is a folder; and it resolves each folder once, not each file's path."""
    from pathlib import Path as P

    from dali_pipe.manifest import PathResolver

    real = tmp_path / "real"
    for rel in ("cat/a.jpg", "cat/b.jpg", "dog/c.jpg", "elsewhere/d.jpg"):
        (real / rel).parent.mkdir(parents=True, exist_ok=True)
        (real / rel).write_bytes(b"x")
    (real / "linked").symlink_to(real / "elsewhere")
    (real / "dog" / "e.jpg").symlink_to(real / "cat" / "a.jpg")
    (real / "dog" / "gone.jpg").symlink_to(real / "nowhere.jpg")
    (real / "dog" / "loop.jpg").symlink_to(real / "dog" / "loop.jpg")
    (real / "folder-link").symlink_to(real / "cat")
    root = tmp_path / "root-link"
    root.symlink_to(real)

    def reference(rel):
        try:
            return str((root / rel).resolve(strict=True))
        except (OSError, RuntimeError):
            return str(root.resolve() / rel)

    rels = ["cat/a.jpg", "cat/b.jpg", "dog/c.jpg", "linked/d.jpg", "dog/e.jpg", "dog/gone.jpg", "dog/loop.jpg",
            "cat/missing.jpg"]
    paths = PathResolver(root)
    assert [paths.absolute(r) for r in rels] == [reference(r) for r in rels]
    assert paths.is_dir("folder-link") and paths.is_dir("cat") and not paths.is_dir("cat/a.jpg")
    assert sorted(paths._folders) == ["cat", "dog", "linked"]  # one resolve a folder
    assert P(paths.absolute("linked/d.jpg")) == real / "elsewhere" / "d.jpg"


def test_columns_give_the_split_order_and_digest_of_the_rule(tmp_path):
    """The split and the digest, computed on columns, are those the rule states, written out one sample at a time:
    val holds the files whose sha256("SEED:PATH") is lowest in each class (at least one, at most all but one), both
    splits in class order then by hash; the digest hashes "path<TAB>class<TAB>split" lines sorted by path."""
    import hashlib
    import os

    files = [f"k{c}/{i:03d}.jpg" for c in range(4) for i in range(3 + 7 * c)]
    text = "image_path\n" + "\n".join(files) + "\n"
    root = _write(tmp_path / "d", text, files)
    for fraction, seed in ((0.25, 0), (0.01, 3), (0.9, 5)):
        m = read_manifest(root, val_fraction=fraction, seed=seed)

        def h(rel):
            return int.from_bytes(hashlib.sha256(f"{seed}:{rel}".encode()).digest()[:8], "big") / 2**64

        want_train, want_val = [], []
        for c in range(4):
            group = sorted((h(f), str((root / f).resolve())) for f in files if f.startswith(f"k{c}/"))
            n_val = min(max(sum(x < fraction for x, _ in group), 1), len(group) - 1)
            want_val += [p for _, p in group[:n_val]]
            want_train += [p for _, p in group[n_val:]]
        assert m.train.files == want_train and m.val.files == want_val
        lines = "".join(f"{os.path.relpath(p, root.resolve())}\t{m.classes[label]}\t{split}\n"
                        for split, part in (("train", m.train), ("val", m.val))
                        for p, label in sorted(zip(part.files, part.labels.tolist())))
        assert m.digest() == hashlib.sha256(lines.encode()).hexdigest()[:16]


def test_unusual_paths_are_normalised_one_by_one(tmp_path):
    """Rows that need normalising (./, //, backslashes, an absolute path under the root) take safe_relpath's way,
    the plain rows the columns' way, and both end as the same files; a NUL or a way out of the root is refused."""
    files = ["cat/a.jpg", "cat/b.jpg", "dog/a.jpg", "dog/b.jpg"]
    root = _write(tmp_path / "d", "", files)
    text = "image_path\n./cat/a.jpg\ncat//b.jpg\ndog\\a.jpg\n" + f"{root.resolve()}/dog/b.jpg\n"
    m = read_manifest(_write(root, text), val_fraction=0.0)
    assert sorted(m.train.files) == sorted(str((root / f).resolve()) for f in files)
    for bad, why in (("cat/a\x00.jpg", "NUL"), ("../x/a.jpg", "escapes")):
        with pytest.raises(ManifestError, match=why):
            read_manifest(_write(root, text + bad + "\n"))


def test_a_one_column_manifest_reads_as_the_csv_reader_reads_it(tmp_path):
    """The one-column fast path (no list per row) gives the rows and line numbers the csv reader gives: blank
    lines, padding, CRLF and lone CR line ends, a BOM, quotes kept as they are."""
    from dali_pipe.manifest import read_table

    text = '\ufeff Image_Path \r\n\r\ncat/a.jpg\r\n  dog/"b".jpg  \n\n   \ncat/c.jpg\rdog/d.jpg\n'
    fast, slow = tmp_path / "fast.tsv", tmp_path / "slow.tsv"
    fast.write_text(text, encoding="utf-8")
    slow.write_text(text.replace("Image_Path", "Image_Path\t", 1), encoding="utf-8")  # a tab: the csv reader
    a, b = read_table(fast), read_table(slow)
    assert a.columns == ["image_path"] and a.header_line == b.header_line == 1
    assert a["image_path"] == b["image_path"] == ['cat/a.jpg', 'dog/"b".jpg', "cat/c.jpg", "dog/d.jpg"]
    assert a["_line"] == b["_line"] == [3, 4, 7, 8]


def test_integer_labels_that_tie_sort_the_same_every_time():
    """'2' and '02' are the same number: text breaks the tie (the order depended on string hashing); a label in
    other digits ('²') is text, not a crash."""
    from dali_pipe.manifest import sort_classes

    assert sort_classes(["10", "02", "2", "-1"]) == ["-1", "02", "2", "10"]
    assert sort_classes(["²", "1"]) == ["1", "²"]
