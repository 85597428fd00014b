"""Directory locks (dali_pipe/workdir.py): outside the directory they guard, a second holder refused naming
the first's PID, nothing stale after kill -9, nothing left after unlock."""
from __future__ import annotations

import os
import signal

import pytest
from helpers import hold_lock

from dali_pipe.workdir import LEGACY_LOCK_NAME, BusyError, lock, lock_path, unlock


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
