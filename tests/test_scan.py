"""Pre-flight scan: bad files are excluded with a reason a person understands, odd ones train."""
from __future__ import annotations

import os

import pytest

import train
from dali_pipe.config import DataSettings
from dali_pipe.scan import check_header, scan

MAX_PIXELS = DataSettings.max_pixels


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    from corpus import make_corpus

    root = tmp_path_factory.mktemp("corpus")
    return root, make_corpus(root)


def _report(out):
    lines = (out / "bad_images.tsv").read_text().splitlines()
    assert lines[0] == "image_path\treason"
    return dict(line.split("\t", 1) for line in lines[1:])


def test_full_scan_epoch_exits_0_and_names_every_bad_file(corpus, tmp_path, cache_dir):
    """One epoch with --scan full: every bad file reported with its reason, no good or odd file listed."""
    root, expected = corpus
    out = tmp_path / "out"
    res = train.main(["--data", str(root), "--model", "tiny", "--epochs", "1", "--batch-size", "4",
                      "--device", "cpu", "--output", str(out), "--scan", "full", "--max-bad-fraction", "0.3",
                      "--num-threads", "2"])
    assert res["global_step"] > 0
    report = _report(out)
    bad = {p: r for p, r in expected.items() if r}
    assert set(report) == set(bad), report
    for p, reason in bad.items():
        assert reason in report[p], (p, report[p])


def test_odd_formats_come_out_as_3_channel_model_size(corpus, tmp_path):
    """CMYK, gray, progressive, EXIF-rotated, PNG variants, BMP, TIFF and 1x1 all decode to 3xHxW."""
    import numpy as np
    from helpers import cpu_options

    from dali_pipe.pipeline import build_pipeline
    from dali_pipe.samples import Files
    from dali_pipe.spec import ImageSpec

    root, expected = corpus
    odd = [str(root / p) for p, r in expected.items() if r is None]
    spec = ImageSpec(64, 64, (0.5,) * 3, (0.5,) * 3)
    for training in (False, True):
        pipe = build_pipeline(Files(odd, list(range(len(odd)))), spec,
                              cpu_options(len(odd), training=training), training=training)
        pipe.build()
        images, labels = pipe.run()
        arr = np.stack([np.asarray(t) for t in images])
        assert arr.shape == (len(odd), 3, 64, 64) and np.isfinite(arr).all()


def test_exif_orientation_is_honoured(corpus):
    """A 160x96 image tagged 'rotate 90' decodes as 96 wide, 160 high."""
    import numpy as np
    from nvidia.dali import fn, pipeline_def, types

    root, _ = corpus

    @pipeline_def
    def p():
        j, _ = fn.readers.file(files=[str(root / "odd/exif_rot.jpg")], labels=[0])
        return fn.decoders.image(j, device="cpu", output_type=types.RGB)

    pipe = p(batch_size=1, num_threads=1, device_id=None)
    pipe.build()
    (out,) = pipe.run()
    assert np.asarray(out[0]).shape == (160, 96, 3)


def test_fast_scan_catches_header_problems(corpus):
    root, expected = corpus
    assert check_header(str(root / "bad/bomb.jpg"), 89_478_485) == "30000x30000 exceeds --max-pixels (89478485)"
    assert check_header(str(root / "bad/text.jpg"), 10**8) == "not an image (text)"
    assert check_header(str(root / "odd/png_named.jpg"), 10**8) is None
    assert check_header(str(root / "odd/tiny1x1.jpg"), 10**8) is None


def test_fast_scan_names_a_link_to_a_fifo_or_a_folder_and_does_not_hang(tmp_path):
    """The header check opens each file once, without blocking: a link to a FIFO (an open would wait for a writer
    forever) and a folder are named; a missing link target is named as before."""
    import os

    os.mkfifo(tmp_path / "pipe")
    os.symlink(tmp_path / "pipe", tmp_path / "to-pipe.jpg")
    (tmp_path / "folder.jpg").mkdir()
    os.symlink(tmp_path / "gone.jpg", tmp_path / "dangling.jpg")
    assert check_header(str(tmp_path / "to-pipe.jpg"), 10**8) == "not a regular file (a FIFO, socket or device)"
    assert check_header(str(tmp_path / "folder.jpg"), 10**8) == "unreadable (Is a directory)"
    assert check_header(str(tmp_path / "dangling.jpg"), 10**8).startswith("dangling symbolic link")


def test_scan_cache_rescans_only_what_changed(corpus, tmp_path):
    """An unchanged rerun decodes nothing; a touched file is the only one re-checked."""
    import os
    import shutil

    root, expected = corpus
    work = tmp_path / "copy"
    shutil.copytree(root, work)
    files = [str(work / p) for p in expected]
    cache = tmp_path / "scan.json"
    first = scan(files, "full", max_pixels=MAX_PIXELS, cache_path=cache, progress=False)
    assert first.checked == len(files) and first.decoded > 0
    again = scan(files, "full", max_pixels=MAX_PIXELS, cache_path=cache, progress=False)
    assert again.checked == 0 and again.decoded == 0 and again.bad == first.bad
    st = os.stat(files[-1])
    os.utime(files[-1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    third = scan(files, "full", max_pixels=MAX_PIXELS, cache_path=cache, progress=False)
    assert third.checked == 1
    # a fast verdict does not satisfy a later full scan
    fast_cache = tmp_path / "fast.json"
    scan(files, "fast", max_pixels=MAX_PIXELS, cache_path=fast_cache, progress=False)
    assert scan(files, "full", max_pixels=MAX_PIXELS, cache_path=fast_cache, progress=False).decoded > 0


def test_a_verdict_about_the_files_place_is_not_kept_and_reasons_name_no_descriptor(photo_root, tmp_path):
    """A file gone between the listing and its check is unreadable now, not for good: back in place with the same
    size and mtime (rsync -a, cp -p), the next scan checks it again (the cache kept the verdict before). A link
    to a socket is named as such, not as a dangling link; PIL's 'cannot identify' names no file object (its
    descriptor number made the serial and parallel scans' reasons differ)."""
    import os
    import shutil
    import socket

    src = next(photo_root.glob("*/*.jpg"))
    f = tmp_path / "a.jpg"
    shutil.copy2(src, f)
    st = os.stat(f)
    stats = ([st.st_size], [st.st_mtime_ns])
    cache = tmp_path / "cache.npz"
    f.rename(tmp_path / "away.jpg")
    gone = scan([str(f)], "fast", max_pixels=MAX_PIXELS, cache_path=cache, progress=False, stats=stats)
    assert gone.bad[str(f)] == "unreadable (No such file or directory)"
    (tmp_path / "away.jpg").rename(f)  # back, the same size and mtime
    back = scan([str(f)], "fast", max_pixels=MAX_PIXELS, cache_path=cache, progress=False, stats=stats)
    assert back.bad == {} and back.checked == 1

    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        os.symlink(tmp_path / "sock", tmp_path / "to-sock.jpg")
        assert check_header(str(tmp_path / "to-sock.jpg"), MAX_PIXELS) == "not a regular file (a FIFO, socket or device)"
    odd = tmp_path / "odd.jpg"
    odd.write_bytes(b"\xff\xd8\xff" + b"\x00" * 200 + b"\xff\xd9")
    assert check_header(str(odd), MAX_PIXELS) == \
        "unreadable JPEG header (UnidentifiedImageError: cannot identify image file)"


def test_too_many_bad_files_abort_with_pointer_to_report(corpus, tmp_path, cache_dir):
    from dali_pipe.dataset import ScanError

    root, _ = corpus
    with pytest.raises(ScanError, match=r"--max-bad-fraction 0.01.*bad_images.tsv"):
        train.main(["--data", str(root), "--model", "tiny", "--epochs", "1", "--device", "cpu",
                    "--output", str(tmp_path / "o"), "--scan", "fast", "--max-bad-fraction", "0.01"])


def test_undetected_bad_file_gets_a_clear_error_pointing_to_full_scan(corpus, tmp_path):
    """With the scan off, a corrupt JPEG still ends the epoch, but with a message that says what to do."""
    from helpers import cpu_options

    from dali_pipe.loader import DaliLoader, PipelineDecodeError
    from dali_pipe.pipeline import build_pipeline
    from dali_pipe.samples import Files
    from dali_pipe.spec import ImageSpec

    root, _ = corpus
    files = [str(root / "odd/gray.jpg"), str(root / "bad/bad_huffman.jpg")]
    pipe = build_pipeline(Files(files, [0, 1]), ImageSpec(32, 32, (0.5,) * 3, (0.5,) * 3),
                          cpu_options(2, training=False), training=False)
    with pytest.raises(PipelineDecodeError, match="could not decode .*bad_huffman.jpg.*--scan full"):
        list(DaliLoader(lambda ck: pipe, training=False))


def test_skip_missing_trains_and_reports_the_missing_and_the_broken_links(photo_root, tmp_path, cache_dir):
    """A missing file (--skip-missing), a dangling symbolic link and a link loop: the run trains on the rest
    and bad_images.tsv names each (a token in a link's target redacted); a good link trains."""
    import os
    import shutil

    data = tmp_path / "d"
    shutil.copytree(photo_root, data)
    (data / "coffee" / "coffee_0003.jpg").unlink()
    os.symlink("/models/hf_" + "a1B2c3D4e5F6g7H8i9J0k1L2/nowhere.jpg", data / "coffee" / "dangling.jpg")
    os.symlink("loop.jpg", data / "coffee" / "loop.jpg")
    os.symlink("coffee_0004.jpg", data / "coffee" / "good_link.jpg")
    with open(data / "dataset.tsv", "a") as f:
        f.write("coffee/dangling.jpg\ncoffee/loop.jpg\ncoffee/good_link.jpg\n")
    out = tmp_path / "o"
    train.main(["--data", str(data), "--model", "tiny", "--epochs", "1", "--batch-size", "8", "--device", "cpu",
                "--output", str(out), "--skip-missing"])
    assert _report(out) == {"coffee/coffee_0003.jpg": "missing on disk (listed in dataset.tsv; --skip-missing)",
                            "coffee/dangling.jpg": "dangling symbolic link (-> /models/[redacted]/nowhere.jpg)",
                            "coffee/loop.jpg": "symbolic link loop (-> loop.jpg)"}


def test_parallel_header_checks_agree_with_one_process(corpus, tmp_path):
    """The header checks in a process per core name the same files, with the same reasons, as one process."""
    root, expected = corpus
    files = [str(root / p) for p in expected]
    serial = scan(files, "fast", max_pixels=MAX_PIXELS, cache_path=None, progress=False, parallel_from=10**9)
    parallel = scan(files, "fast", max_pixels=MAX_PIXELS, cache_path=None, progress=False, parallel_from=1)
    assert parallel.bad == serial.bad and parallel.checked == serial.checked == len(files)
    assert serial.bad  # the corpus has bad files


def test_scan_cache_is_columns_and_survives_damage(corpus, tmp_path):
    """The verdicts are saved as columns of numbers (no path in the file); a damaged or foreign cache file is only
    a slower scan; a changed --max-pixels re-checks; the listing's stats stand in for a stat of each file."""
    import numpy as np

    from dali_pipe.scan import Verdicts

    root, expected = corpus
    files = [str(root / p) for p in expected]
    cache = tmp_path / "scan-cache.npz"
    first = scan(files, "fast", max_pixels=MAX_PIXELS, cache_path=cache, progress=False)
    raw = cache.read_bytes()
    assert not any(p.encode() in raw for p in files) and str(root).encode() not in raw
    assert len(Verdicts.load(cache).c["hi"]) == len(files)
    for junk in (b"", b"PK\x03\x04 not a zip", b'{"a": 1}'):
        cache.write_bytes(junk)
        again = scan(files, "fast", max_pixels=MAX_PIXELS, cache_path=cache, progress=False)
        assert again.checked == len(files) and again.bad == first.bad
    assert scan(files, "fast", max_pixels=MAX_PIXELS, cache_path=cache, progress=False).checked == 0
    lower = scan(files, "fast", max_pixels=MAX_PIXELS - 1, cache_path=cache, progress=False)
    assert lower.checked == len(files)
    sizes = np.array([os.stat(f).st_size for f in files])
    mtimes = np.array([os.stat(f).st_mtime_ns for f in files])
    hit = scan(files, "fast", max_pixels=MAX_PIXELS - 1, cache_path=cache, progress=False, stats=(sizes, mtimes))
    assert hit.checked == 0 and hit.bad == lower.bad
    mtimes[0] += 1  # the listing saw another mtime: that file is checked again
    assert scan(files, "fast", max_pixels=MAX_PIXELS - 1, cache_path=cache, progress=False,
                stats=(sizes, mtimes)).checked == 1


def test_verdicts_replace_old_ones_and_a_shared_first_half_costs_a_check_not_a_wrong_verdict():
    import numpy as np

    from dali_pipe.scan import Verdicts

    keys = np.zeros(3, dtype=[("hi", np.uint64), ("lo", np.uint64)])
    keys["hi"], keys["lo"] = [5, 5, 9], [1, 2, 3]  # the first two share their first half
    v = Verdicts()
    v.add(keys, [10, 20, 30], [1, 2, 3], 100, [1, 1, 1], [None, "bad", None])
    v.add(keys[2:], [31], [4], 100, [2], ["worse"])  # a new verdict for the third
    assert len(v.c["hi"]) == 3 and v.reasons[v.c["reason"][v.lookup(keys[2:])[0]]] == "worse"
    rows = v.lookup(keys)
    found = [r for r in rows[:2] if r >= 0]
    assert len(found) >= 1 and all(v.c["lo"][r] in (1, 2) for r in found)  # never another file's verdict
    for r, k in zip(rows, keys):
        assert r < 0 or (v.c["hi"][r], v.c["lo"][r]) == (k["hi"], k["lo"])
    other = np.zeros(1, dtype=keys.dtype)
    other["hi"], other["lo"] = 7, 7
    assert v.lookup(other)[0] == -1


def test_a_cache_with_the_right_names_and_the_wrong_shapes_is_only_a_slower_scan(corpus, tmp_path):
    import numpy as np

    root, expected = corpus
    files = [str(root / p) for p in expected]
    cache = tmp_path / "scan-cache.npz"
    with open(cache, "wb") as f:
        np.savez(f, **{k: np.zeros((2, 2), dtype=np.int64) for k in ("hi", "lo", "size", "mtime", "max_pixels",
                                                                      "level", "reason")},
                 reasons=np.frombuffer(b'["x"]', dtype=np.uint8))
    assert scan(files, "fast", max_pixels=MAX_PIXELS, cache_path=cache, progress=False).checked == len(files)
