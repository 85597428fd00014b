"""What a transfer may change of its process: malloc's thresholds kept where glibc is the C library and the user
has not tuned malloc, never without glibc, and both they and the open-file limit only in our own commands."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dali_pipe import limits

LEFT_ALONE = {"MALLOC_ARENA_TEST": "8"}  # glibc's own default on 64-bit: malloc as it is
glibc_only = pytest.mark.skipif(not limits.on_glibc(), reason="glibc's malloc only")


@glibc_only
@pytest.mark.parametrize("env", [{"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}, {"MALLOC_ARENA_MAX": "4"},
                                 {"MALLOC_TOP_PAD_": ""}, LEFT_ALONE])
def test_malloc_tuned_by_the_user_is_left_alone(env):
    """Set, even empty (glibc reads an empty MALLOC_TOP_PAD_ as 0), the user's malloc settings win."""
    import subprocess
    import sys

    code = "from dali_pipe.limits import keep_freed_memory; print(keep_freed_memory(one_arena=True))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}, **env})
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("refusal", [ValueError, OSError, AttributeError])
def test_no_glibc_no_mallopt(monkeypatch, refusal):
    """musl, macOS, Windows: nothing asked of a C library that has no such knobs."""
    def not_glibc(name):
        raise refusal("unrecognized configuration name")

    monkeypatch.setattr(limits, "_memory_kept", None)
    monkeypatch.setattr(limits.os, "confstr", not_glibc, raising=False)
    monkeypatch.setattr(limits.ctypes, "CDLL", lambda *a: pytest.fail("mallopt called without glibc"))
    assert limits.keep_freed_memory(one_arena=True) is False


@pytest.mark.parametrize("ours", [False, True])
def test_only_our_commands_tune_the_process(ours):
    """An engine in a user's own process (the library, imported) leaves malloc and the open-file limit as they
    are, and takes fewer requests where the limit is short; in our commands (own_process) it raises the soft
    limit towards the hard one and keeps freed memory."""
    import resource

    code = ("import resource; from dali_pipe import limits, transfer; "
            + ("limits.own_process(); " if ours else "")
            + "e = transfer.Engine(concurrency=256, connect_timeout=1, read_timeout=1, attempts=1); "
            "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], e.concurrency, limits._memory_kept); e.close()")
    _, top = resource.getrlimit(resource.RLIMIT_NOFILE)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (300, top)))
    soft, concurrency, kept = out.stdout.split()
    if ours:
        assert int(soft) > 300 and concurrency == "256" and kept == str(limits.on_glibc())
    else:
        assert soft == "300" and concurrency == "86" and kept == "None", out.stdout
        assert "leaves room for 86 S3 requests in flight" in out.stderr


def test_our_main_called_from_a_users_own_code_leaves_malloc_alone(s3, photo_root, tmp_path):
    """`main(["sync", ...])` from a user's script is library use: the sync runs, malloc is left as it is (before,
    the sync command set its thresholds and one arena for the user's whole process)."""
    import boto3

    client = boto3.client("s3")
    client.create_bucket(Bucket="bkt")
    photo = next(photo_root.rglob("*.jpg"))
    client.upload_file(str(photo), "bkt", "ds/c/a.jpg")
    client.put_object(Bucket="bkt", Key="ds/dataset.tsv", Body=b"image_path\tlabel\nc/a.jpg\tc\n")
    code = ("import sys; from dali_pipe import limits; from dali_pipe.cli.commands import main; "
            f"main(['sync', 's3://bkt/ds', {str(tmp_path / 'd')!r}, '--no-progress']); print(limits._memory_kept)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "None" and (tmp_path / "d" / "c" / "a.jpg").is_file()
