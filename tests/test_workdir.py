"""Directory locks (dali_pipe/workdir.py): outside the directory they guard, a second holder refused naming
the first's PID, nothing stale after kill -9, nothing left after unlock. Output directories: sizes in
readable units, a full disk named as such, dead writers' leftovers removed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from helpers import hold_lock

from dali_pipe.workdir import (
    LEGACY_LOCK_NAME,
    BusyError,
    OutputError,
    atomic,
    check_writable,
    human_bytes,
    lock,
    lock_path,
    remove_dead_temps,
    unlock,
    write_atomic,
)


def test_lock_puts_nothing_in_the_directory_and_a_second_holder_is_refused(tmp_path, cache_dir):
    """Another process holds OUT: this one is refused naming its PID, and OUT holds no file of ours."""
    out = tmp_path / "model"
    holder = hold_lock(out, "training run")
    try:
        with pytest.raises(BusyError, match=rf"{out} is in use by another training run \(PID {holder.pid}\); wait"):
            lock(out, "training run", "wait for it to finish")
        assert list(out.iterdir()) == []
        assert lock_path(out).parent == cache_dir / "locks"
    finally:
        holder.kill()
        holder.wait()


def test_a_token_in_the_guarded_path_stays_out_of_the_lock_file(tmp_path, cache_dir):
    """The lock file (left behind by a kill -9) names the holder without a secret the path carries: neither
    its name nor its content holds an hf_ token in --output's path."""
    token = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWx"
    out = tmp_path / f"out_{token}"
    lock(out, "training run", "wait")
    try:
        path = lock_path(out)
        assert path.is_file() and token not in path.name and token not in path.read_text()
        assert path.read_text().startswith(f"{os.getpid()}\t")
    finally:
        unlock(out)


def test_kill_9_leaves_no_lock_that_blocks_the_rerun(tmp_path, cache_dir):
    """The holder dies by kill -9 (its lock file stays, outside the directory): the next lock succeeds and
    its unlock removes the file."""
    dest = tmp_path / "sync-target"
    holder = hold_lock(dest, "sync")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    lock(dest, "sync", "wait")
    try:
        assert str(os.getpid()) in lock_path(dest).read_text() and list(dest.iterdir()) == []
    finally:
        unlock(dest)
    assert not lock_path(dest).exists()


def test_the_same_directory_by_another_path_is_the_same_lock(tmp_path, cache_dir):
    """A symlink to a held directory names the same lock (keyed by the resolved path)."""
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    holder = hold_lock(real, "pack")
    try:
        with pytest.raises(BusyError, match=rf"PID {holder.pid}"):
            lock(tmp_path / "alias", "pack", "pack into another folder")
    finally:
        holder.kill()
        holder.wait()


def test_an_older_versions_lock_file_in_the_directory_is_removed(tmp_path, cache_dir):
    """DIR/.dali_pipe.lock left by an older version (its process gone) is removed by the next lock, so it
    never reaches a model.tar.gz or an upload."""
    out = tmp_path / "model"
    out.mkdir()
    (out / LEGACY_LOCK_NAME).write_text("12345")
    lock(out, "training run", "wait")
    unlock(out)
    assert list(out.iterdir()) == []


def test_sizes_are_given_in_a_unit_that_keeps_them_readable():
    assert [human_bytes(n) for n in (0, 812, 5 << 10, 1536 << 10, 3 << 30, 5 << 40)] == \
        ["0 bytes", "812 bytes", "5.0 KiB", "1.5 MiB", "3.0 GiB", "5.0 TiB"]


def test_the_room_check_on_a_small_disk_never_says_0_0_gib(tmp_path):
    """A 1 MiB disk (tmpfs) for a run that writes 5 MiB; then the same disk full: each one clear line."""
    from helpers import fill, small_disk

    with small_disk(tmp_path / "disk", "1m") as disk:
        with pytest.raises(OutputError, match=r"--output .* has 1\.0 MiB free but the run writes about "
                                              r"5\.0 MiB there"):
            check_writable(disk / "out", "--output", 5 << 20)
        fill(disk)
        with pytest.raises(OutputError, match=r"--output .*out is full \(No space left on device\); free space"):
            check_writable(disk / "out", "--output")
        assert not list((disk / "out").glob(".write-test-*"))


def test_temporary_folders_of_dead_writers_go_and_those_of_live_ones_stay(tmp_path):
    """Files and folders named ...-PID: removed when PID is dead (or is ours, at the start of a run:
    another container's, restored with the folder); kept while their writer lives."""
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True).stdout)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        for pid in (dead, live.pid, os.getpid()):
            (tmp_path / f".model-tmp-{pid}").mkdir()
            (tmp_path / f".model-tmp-{pid}" / "model.safetensors").write_bytes(b"partial")
        remove_dead_temps(tmp_path, ".model-tmp-*")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f".model-tmp-{p}" for p in (live.pid, os.getpid()))
        remove_dead_temps(tmp_path, ".model-tmp-*", include_own=True)
        assert [p.name for p in tmp_path.iterdir()] == [f".model-tmp-{live.pid}"]
    finally:
        live.kill()


def test_remove_deletes_only_inside_the_folder_it_is_given(tmp_path):
    """The one checked way to delete: a file, a link (as itself) or a folder inside OWNER goes; a path that
    lies outside it (`..`, absolute, through a symlinked folder) is refused and nothing is touched."""
    from dali_pipe.workdir import OutsideError, move, remove

    owner, victim = tmp_path / "out", tmp_path / "victim"
    owner.mkdir()
    victim.mkdir()
    (victim / "precious").write_text("keep")
    (owner / "escape").symlink_to(victim)  # a symlinked folder inside OWNER that points outside it
    (owner / "old").mkdir()
    (owner / "old" / "f").write_text("x")
    (owner / "old" / "link").symlink_to(victim / "precious")
    for outside in (owner / ".." / "victim", victim / "precious", owner / "escape" / "precious", owner, owner / "."):
        with pytest.raises(OutsideError, match="outside"):
            remove(outside, owner)
    with pytest.raises(OutsideError):
        move(owner / "old", victim / "moved", owner)
    assert remove(owner / "escape", owner) and remove(owner / "old", owner) and not remove(owner / "gone", owner)
    assert (victim / "precious").read_text() == "keep" and list(owner.iterdir()) == []


def test_no_module_deletes_a_folder_but_through_the_checked_helper():
    """shutil.rmtree is called in dali_pipe/workdir.py only: every folder we delete is checked to lie inside the
    folder we own (workdir.remove)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    callers = [str(p.relative_to(root)) for d in ("dali_pipe", "model") for p in (root / d).rglob("*.py")
               if "rmtree(" in p.read_text() and p.name != "workdir.py"]
    assert callers == [], callers


def test_no_module_renames_a_file_into_place_but_through_the_one_helper():
    """os.replace and os.rename are called in dali_pipe/workdir.py only (atomic(), move()): every file we write
    lands the same way, whole or not at all, its temporary file removed on failure."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    callers = []
    for p in [root / "train.py", *(q for d in ("dali_pipe", "model") for q in (root / d).rglob("*.py"))]:
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Attribute) and node.attr in ("replace", "rename")
                    and isinstance(node.value, ast.Name) and node.value.id == "os" and p.name != "workdir.py"):
                callers.append(f"{p.relative_to(root)}:{node.lineno}")
    assert callers == [], callers


def test_atomic_lands_whole_or_not_at_all(tmp_path):
    """The file is its old self until the block ends, then the new one; a block that fails leaves the old file
    and no temporary one; a full disk's error (which names no file) names the target."""
    import errno

    target = tmp_path / "metrics.json"
    target.write_text("old")
    with atomic(target) as tmp:
        tmp.write_text("new")
        assert target.read_text() == "old" and tmp.parent == tmp_path and tmp.name.startswith(".")
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]

    with pytest.raises(OSError) as e:
        with atomic(target) as tmp:
            tmp.write_text("half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert e.value.filename == str(target)
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]

    with pytest.raises(KeyboardInterrupt):
        with atomic(tmp_path / "other", tmp_path / ".folder-tmp") as tmp:
            (tmp / "x").mkdir(parents=True)  # a folder being written goes too
            raise KeyboardInterrupt
    write_atomic(tmp_path / "text.txt", "caf\u00e9")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json", "text.txt"]
    assert (tmp_path / "text.txt").read_bytes() == "caf\u00e9".encode()


def test_write_failures_are_found_behind_the_errors_that_wrap_them(tmp_path):
    """A refused write named with its path and the fix, also when a library wraps it (Lightning's logger
    raises ValueError from the OSError); a missing path counts only inside the run's folders, a denied one
    too (reading an input without permission is not an output failure)."""
    import errno

    from dali_pipe.workdir import fix_for, output_failure

    out = tmp_path / "out"
    (out / "tensorboard").mkdir(parents=True)
    ro = OSError(errno.EROFS, "Read-only file system", str(out / "tensorboard" / "events"))
    try:
        try:
            raise ro
        except OSError as e:
            raise ValueError("you tried to log 1.1 which is currently not supported") from e
    except ValueError as wrapped:
        path, why = output_failure(wrapped, [out])
    assert (path, why) == (out / "tensorboard" / "events", "Read-only file system")
    assert fix_for(why, path) == f"make {out / 'tensorboard'} writable for this user"
    gone = FileNotFoundError(errno.ENOENT, "No such file or directory", str(tmp_path / "logs" / "events"))
    assert output_failure(gone, [out]) is None and output_failure(gone) is None
    assert output_failure(gone, [out, tmp_path / "logs"]) == (tmp_path / "logs", "No such file or directory: "
                                                                               "removed while the run wrote there")
    denied = PermissionError(errno.EACCES, "Permission denied", "/data/dataset.tsv")
    assert output_failure(denied, [out]) is None
    full = OSError(errno.ENOSPC, "No space left on device")
    assert fix_for(output_failure(full, [out])[1], out) == f"free space on the disk of {out}"
