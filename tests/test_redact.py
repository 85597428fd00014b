"""One redaction function for everything printed: flags, key=value, JSON, URIs, AWS keys, HF tokens."""
from __future__ import annotations

import io

import pytest
from helpers import copy_trained

from dali_pipe.redact import RedactingStream, redact, redact_argv

SECRETS = ["hunter2", "AKIAABCDEFGHIJKLMNOP", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
           "hf_abcdefghijklmnopqrstuvwxyz123", "s3cr3tpass"]


@pytest.mark.parametrize("text", [
    "--aws-secret-access-key wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY --epochs 3",
    "--hf-token=hf_abcdefghijklmnopqrstuvwxyz123",
    "AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    '{"db_password": "hunter2", "epochs": "3"}',
    "endpoint http://admin:s3cr3tpass@minio.local:9000 unreachable",
    "key id AKIAABCDEFGHIJKLMNOP in use",
    "token: hf_abcdefghijklmnopqrstuvwxyz123",
    "api_key=hunter2&x=1",
    "s3://b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=hunter2%2F20240101%2Fus-east-1&X-Amz-Signature=s3cr3tpass",
    "https://b.s3.amazonaws.com/k?AWSAccessKeyId=x&Expires=1&Signature=hunter2&X-Amz-Security-Token=s3cr3tpass",
    "/models/my_hf_abcdefghijklmnopqrstuvwxyz123/config.json",
])
def test_secrets_are_masked(text):
    out = redact(text)
    assert "[redacted]" in out
    assert not any(s in out for s in SECRETS), out


def test_ordinary_text_is_left_alone():
    for text in ["METRIC epoch=3 train_loss=0.4054 train_acc=0.9261 val_loss=0.3548 val_acc=0.8750",
                 "--batch-size 64 --model google/vit-base-patch16-224 --data s3://bucket/prefix",
                 "sha1 0123456789abcdef0123456789abcdef01234567", "progress: epoch 1/5 step 10/40 (25%)"]:
        assert redact(text) == text


def test_argv_values_after_secret_flags():
    assert redact_argv(["--hf-token", "hf_abcdefghijklmnopqrstuvwxyz123", "--epochs", "3"]) == \
        ["--hf-token", "[redacted]", "--epochs", "3"]


def test_stream_sees_a_secret_split_across_writes():
    sink = io.StringIO()
    s = RedactingStream(sink)
    s.write("connecting to http://admin:s3cr")
    s.write("3tpass@host\nnext line\n")
    s.flush()
    assert "s3cr3tpass" not in sink.getvalue() and "next line" in sink.getvalue()


TOKEN = "hf_" + "AbCdEfGhIjKlMnOpQrStUvWx12"
SIGNATURE = "0123456789abcdef" * 4


def test_no_file_a_run_writes_carries_a_secret_of_its_paths(trained, tmp_path, monkeypatch, capsys):
    """An hf_ token inside the --model and --data paths: absent from every file training and evaluate write
    (hparams.yaml, the TensorBoard event files, last.json, last.ckpt and its members, metrics.json, the
    caches) and from everything printed; a presigned URL's signature in --data is never printed."""
    import signal
    import sys
    import zipfile

    import train
    from dali_pipe.cli import cli
    from dali_pipe.cli.commands import main as commands
    from dali_pipe.demo import make_photo_dataset

    model = tmp_path / TOKEN / "model"
    copy_trained(trained, model, model_only=True)
    data = make_photo_dataset(tmp_path / f"data-{TOKEN}", classes=2, per_class=6)
    monkeypatch.setenv("DALI_PIPE_CACHE", str(tmp_path / "cache"))
    out, ev = tmp_path / "out", tmp_path / "eval"
    handler, streams = signal.getsignal(signal.SIGTERM), (sys.stdout, sys.stderr)
    try:
        assert cli(lambda: train.main(["--data", str(data), "--model", str(model), "--device", "cpu", "--epochs", "1",
                                       "--batch-size", "4", "--num-threads", "1", "--output", str(out)])) == 0
        assert cli(lambda: commands(["evaluate", "--model", str(model), "--data", str(data), "--device", "cpu",
                                     "--output", str(ev)])) == 0
        assert cli(lambda: train.main(["--data", f"/no/such?X-Amz-Credential=x&X-Amz-Signature={SIGNATURE}",
                                       "--output", str(tmp_path / "o2")])) == 2
    finally:
        signal.signal(signal.SIGTERM, handler)
        sys.stdout, sys.stderr = streams
    printed = capsys.readouterr()
    assert "X-Amz-Signature=[redacted]" in printed.err
    for text in printed:
        assert TOKEN not in text and SIGNATURE not in text
    written = [f for root in (out, ev, tmp_path / "cache") for f in root.rglob("*") if f.is_file()]
    kinds = {f.name.split(".")[0] for f in written}
    assert {"hparams", "events", "last", "metrics"} <= kinds, kinds
    assert "[redacted]" in (out / "tensorboard" / "hparams.yaml").read_text()
    for f in written:
        assert TOKEN.encode() not in f.read_bytes(), f
        if zipfile.is_zipfile(f):
            with zipfile.ZipFile(f) as z:
                assert not [m for m in z.namelist() if TOKEN.encode() in z.read(m)], f
