"""SageMaker contract (fake /opt/ml in tmp_path), spot-safe checkpoints, SIGTERM and kill -9."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from dali_pipe.cli.sagemaker import build_argv

ROOT = Path(__file__).resolve().parents[1]


def _opt_ml(tmp_path, photo_root, hp: dict, resources=None):
    base = tmp_path / "opt_ml"
    cfg = base / "input" / "config"
    cfg.mkdir(parents=True)
    (cfg / "hyperparameters.json").write_text(json.dumps(hp))
    (cfg / "inputdataconfig.json").write_text(json.dumps({"training": {"TrainingInputMode": "File"}}))
    (cfg / "resourceconfig.json").write_text(json.dumps(resources or {"current_host": "algo-1", "hosts": ["algo-1"]}))
    (base / "input" / "data").mkdir(parents=True)
    os.symlink(photo_root, base / "input" / "data" / "training")
    return base


def _run(base, cache_dir, *args, timeout=600):
    env = {**os.environ, "SAGEMAKER_BASE_DIR": str(base), "DALI_PIPE_CACHE": str(cache_dir)}
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
    assert "Traceback" not in r.stderr


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
