"""SageMaker contract (fake /opt/ml in tmp_path), spot-safe checkpoints, SIGTERM and kill -9."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dali_pipe.cli.sagemaker import build_argv

ROOT = Path(__file__).resolve().parents[1]


def _opt_ml(tmp_path, photo_root, hp: dict, resources=None):
    base = tmp_path / "opt_ml"
    tmp_path.mkdir(parents=True, exist_ok=True)
    cfg = base / "input" / "config"
    cfg.mkdir(parents=True)
    (cfg / "hyperparameters.json").write_text(json.dumps(hp))
    (cfg / "inputdataconfig.json").write_text(json.dumps({"training": {"TrainingInputMode": "File"}}))
    (cfg / "resourceconfig.json").write_text(json.dumps(resources or {"current_host": "algo-1", "hosts": ["algo-1"]}))
    (base / "input" / "data").mkdir(parents=True)
    os.symlink(photo_root, base / "input" / "data" / "training")
    return base


def _run(base, cache_dir, *args, timeout=600, env=None):
    env = {**os.environ, "SAGEMAKER_BASE_DIR": str(base), "DALI_PIPE_CACHE": str(cache_dir), **(env or {})}
    return subprocess.run([sys.executable, str(ROOT / "train.py"), "train", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_train_writes_model_logs_and_metrics(tmp_path, photo_root, cache_dir):
    base = _opt_ml(tmp_path, photo_root, {"epochs": "2", "batch-size": "8", "model": "tiny", "device": "cpu",
                                          "num-threads": "1"})
    r = _run(base, cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (base / "model" / "config.json").is_file() and (base / "model" / "label_map.json").is_file()
    assert list((base / "output" / "tensorboard").glob("events.*"))
    assert (base / "checkpoints" / "last.ckpt").is_file()
    assert not (base / "output" / "failure").exists()
    import re

    # the README's metric_definitions regexes
    assert re.search(r"METRIC epoch=2 .*train_loss=([0-9.]+)", r.stdout)
    assert re.search(r"val_acc=([0-9.]+)", r.stdout)


def test_bad_hyperparameter_writes_failure(tmp_path, photo_root, cache_dir):
    base = _opt_ml(tmp_path, photo_root, {"epochs": "banana", "model": "tiny", "device": "cpu"})
    r = _run(base, cache_dir, timeout=120)
    assert r.returncode != 0
    failure = (base / "output" / "failure").read_text()
    assert "epochs" in failure and "banana" in failure and len(failure) <= 1024
    assert "Traceback" not in r.stderr and "Traceback" not in failure


def test_two_host_resourceconfig_sets_rank_and_master(tmp_path):
    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "resourceconfig.json").write_text(
        json.dumps({"current_host": "algo-2", "hosts": ["algo-1", "algo-2"]}))
    argv, env = build_argv(base, [], {})
    assert env["MASTER_ADDR"] == "algo-1" and env["NODE_RANK"] == "1" and env["MASTER_PORT"] == "29500"
    assert argv[argv.index("--num-nodes") + 1] == "2" and argv[argv.index("--devices") + 1] == "auto"
    assert argv[argv.index("--data") + 1] == str(base / "input" / "data" / "training")
    assert argv[argv.index("--output") + 1] == str(base / "model")


def test_sm_env_and_s3_data_hyperparameter(tmp_path):
    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"data": "s3://b/p"}))
    argv, env = build_argv(base, [], {"SM_MODEL_DIR": "/m", "SM_NUM_GPUS": "4", "SM_HOSTS": '["h1"]',
                                      "SM_CURRENT_HOST": "h1"})
    assert argv[argv.index("--data") + 1] == "s3://b/p" and "--num-nodes" not in argv
    assert argv[argv.index("--output") + 1] == "/m" and argv[argv.index("--devices") + 1] == "4"


def test_hyperparameters_as_sagemaker_sends_them(tmp_path, capsys):
    """Framework estimators JSON-encode values and add sagemaker_* keys; tuning jobs add
    _tuning_objective_metric. Values unwrap, SageMaker's keys are ignored with one note."""
    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    hp = {"model": '"tiny"', "epochs": "3", "batch_size": 16, "monitor": "true", "lr": "0.001",
          "sagemaker_program": '"train.py"', "sagemaker_region": '"us-east-1"', "sagemaker_submit_directory": '"s3://x"',
          "_tuning_objective_metric": "validation:accuracy"}
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps(hp))
    (base / "input" / "config" / "inputdataconfig.json").write_text(
        json.dumps({"training": {"TrainingInputMode": "FastFile"}}))
    argv, _ = build_argv(base, [], {})
    assert argv[:10] == ["--model", "tiny", "--epochs", "3", "--batch-size", "16", "--monitor", "true", "--lr", "0.001"]
    note = capsys.readouterr().out
    assert "ignoring 4 key(s) set by SageMaker itself: _tuning_objective_metric, sagemaker_program" in note
    from dali_pipe.cli import parse_train

    assert parse_train([a for a in argv if not a.startswith("/")][:10]).model.model == "tiny"


def test_bad_hyperparameters_are_each_named(tmp_path):
    from dali_pipe.cli.sagemaker import SageMakerError

    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps(
        {"batchsize": "8", "model": None, "aws-secret-access-key": "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
         "output": "/x"}))
    with pytest.raises(SageMakerError) as e:
        build_argv(base, [], {})
    msg = str(e.value)
    assert "unknown hyperparameter 'batchsize' (did you mean 'batch-size'?)" in msg
    assert "hyperparameter 'model' is null" in msg and "'output' is set by the SageMaker contract" in msg
    assert "unknown hyperparameter 'aws-secret-access-key'" in msg and "wJalr" not in msg
    assert "environment, not hyperparameters" in msg


def test_secrets_never_reach_stdout_stderr_or_failure(tmp_path, photo_root, cache_dir):
    """A secret in a bad hyperparameter's value; then user:pass@ in AWS_ENDPOINT_URL when S3 fails."""
    secret = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
    env = {"AWS_ENDPOINT_URL": "http://admin:s3cr3tpass@127.0.0.1:9", "AWS_ACCESS_KEY_ID": "AKIAABCDEFGHIJKLMNOP",
           "AWS_SECRET_ACCESS_KEY": secret, "AWS_DEFAULT_REGION": "us-east-1"}
    runs = [({"epochs": f"--token={secret}", "model": "tiny", "device": "cpu"}, "--epochs"),
            ({"model": "tiny", "device": "cpu", "data": "s3://bucket/prefix"}, "cannot reach http://[redacted]@127.0.0.1:9")]
    for i, (hp, expected) in enumerate(runs):
        base = _opt_ml(tmp_path / str(i), photo_root, hp)
        r = _run(base, cache_dir, timeout=180, env=env)
        failure = (base / "output" / "failure").read_text()
        for text in (r.stdout, r.stderr, failure):
            assert secret not in text and "s3cr3tpass" not in text and "AKIAABCDEFGHIJKLMNOP" not in text, text
        assert expected in failure and "Traceback" not in failure and r.returncode == 1, failure


def test_failure_text_is_redacted_and_bounded(tmp_path):
    from dali_pipe.cli.sagemaker import write_failure

    write_failure(tmp_path, "boom AKIAABCDEFGHIJKLMNOP secret_key=hunter2 " + "x" * 3000)
    text = (tmp_path / "failure").read_text()
    assert "AKIA" not in text and "hunter2" not in text and len(text) <= 1024


def test_hyperparameter_spellings_are_not_overridden(tmp_path):
    """'cache_dir' and 'cache-dir' both count as the user's choice; the contract adds no second value."""
    base = tmp_path / "opt_ml"
    (base / "input" / "config").mkdir(parents=True)
    (base / "input" / "config" / "hyperparameters.json").write_text(json.dumps({"cache_dir": "/nvme", "devices": "2"}))
    argv, _ = build_argv(base, [], {})
    assert argv.count("--cache-dir") == 1 and argv[argv.index("--cache-dir") + 1] == "/nvme"
    assert argv.count("--devices") == 1
