"""One redaction function for everything printed: flags, key=value, JSON, URIs, AWS keys, HF tokens."""
from __future__ import annotations

import io

import pytest

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
