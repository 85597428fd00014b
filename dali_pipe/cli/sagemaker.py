"""The SageMaker bring-your-own-container contract: `docker run IMAGE train`.

Maps /opt/ml (or $SAGEMAKER_BASE_DIR) onto train.py's flags and hands them to the same parser:
- input/config/hyperparameters.json: string values, keys are CLI flags ("batch-size": "64");
- input/config/inputdataconfig.json: data from the `training` channel (input/data/training),
  unless a `data` hyperparameter names an s3:// URI;
- input/config/resourceconfig.json: several hosts -> MASTER_ADDR (first host), NODE_RANK,
  --num-nodes, and all local GPUs;
- model/ gets the save_pretrained model + label map, output/tensorboard the logs,
  /opt/ml/checkpoints the spot-safe checkpoints (SageMaker syncs them to S3);
- any failure writes a short reason to output/failure (<= 1024 chars, no secrets) and exits 1.
The sagemaker-training toolkit's SM_* variables are honoured as defaults.
"""
from __future__ import annotations

import json
import os
import re
import sys
import traceback
from pathlib import Path

from ..errors import UserError

FAILURE_LIMIT = 1024
_SECRET = re.compile(r"(AKIA|ASIA)[A-Z0-9]{12,}|(?i:(secret|token|password|session)[^\s:=]*\s*[:=]\s*)\S+")


class SageMakerError(UserError):
    """The job's configuration is unusable; the message names the file or hyperparameter."""


def _flag(key) -> str:
    """The CLI flag a hyperparameter key names: 'batch_size', 'batch-size' and '--batch-size' alike."""
    return "--" + str(key).lstrip("-").replace("_", "-")


def _read_json(path: Path):
    """The file's JSON, or {} where SageMaker did not write it (a local run may omit any of them)."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise SageMakerError(f"{path} is not valid JSON ({e})") from None


def build_argv(base: Path, extra: list[str], env: dict) -> tuple[list[str], dict]:
    """The train.py argv and the distributed environment for this host."""
    cfg = base / "input" / "config"
    hp = _read_json(cfg / "hyperparameters.json")
    if not isinstance(hp, dict):
        raise SageMakerError(f"{cfg / 'hyperparameters.json'} must hold a JSON object of flag -> string")
    channels = _read_json(cfg / "inputdataconfig.json")
    resources = _read_json(cfg / "resourceconfig.json")

    argv: list[str] = []
    given = {_flag(k) for k in hp}  # flags the hyperparameters set
    for key, value in hp.items():
        flag = _flag(key)
        if flag in ("--output", "--log-dir", "--checkpoint-dir"):
            raise SageMakerError(f"hyperparameter {key!r} is set by the SageMaker contract; remove it")
        if isinstance(value, bool):
            value = str(value).lower()
        argv += [flag, str(value)]

    if "--data" not in given:
        channel = Path(env.get("SM_CHANNEL_TRAINING", base / "input" / "data" / "training"))
        if channels and "training" not in channels:
            raise SageMakerError(f"inputdataconfig.json has channels {sorted(channels)} but no 'training'; name the "
                                 "channel 'training' or pass a 'data' hyperparameter with an s3:// URI")
        mode = (channels.get("training") or {}).get("TrainingInputMode", "File")
        if mode != "File":
            raise SageMakerError(f"the training channel uses TrainingInputMode {mode!r}; only File mode is supported "
                                 "(or pass a 'data' hyperparameter with an s3:// URI)")
        argv += ["--data", str(channel)]

    model_dir = Path(env.get("SM_MODEL_DIR", base / "model"))
    output_dir = Path(env.get("SM_OUTPUT_DATA_DIR", base / "output"))
    argv += ["--output", str(model_dir), "--log-dir", str(output_dir / "tensorboard"),
             "--checkpoint-dir", str(base / "checkpoints")]
    if "--cache-dir" not in given:
        argv += ["--cache-dir", "/tmp/dali_pipe"]  # NVMe on g4dn

    hosts = resources.get("hosts") or json.loads(env.get("SM_HOSTS", "[]") or "[]")
    current = resources.get("current_host") or env.get("SM_CURRENT_HOST")
    dist_env = {}
    num_gpus = int(env.get("SM_NUM_GPUS", "-1"))
    if len(hosts) > 1:
        hosts = sorted(hosts)
        if current not in hosts:
            raise SageMakerError(f"resourceconfig.json: current_host {current!r} is not in hosts {hosts}")
        dist_env = {"MASTER_ADDR": hosts[0], "MASTER_PORT": env.get("MASTER_PORT", "29500"),
                    "NODE_RANK": str(hosts.index(current))}
        argv += ["--num-nodes", str(len(hosts))]
    if "--devices" not in given and num_gpus != 0:
        argv += ["--devices", "auto" if num_gpus < 0 else str(num_gpus)]
    return argv + extra, dist_env


def _redact(text: str) -> str:
    return _SECRET.sub("[redacted]", text)


def write_failure(output_dir: Path, reason: str) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    text = _redact(reason.strip())
    if len(text) > FAILURE_LIMIT:
        text = text[: FAILURE_LIMIT - 3] + "..."
    (output_dir / "failure").write_text(text)


def run_sagemaker(extra: list[str], main) -> dict:
    """Run train.py's `main` as a SageMaker job; on failure write output/failure and exit 1."""
    base = Path(os.environ.get("SAGEMAKER_BASE_DIR", "/opt/ml"))
    output_dir = Path(os.environ.get("SM_OUTPUT_DATA_DIR", base / "output"))
    try:
        argv, dist_env = build_argv(base, extra, dict(os.environ))
        os.environ.update(dist_env)
        print(f"sagemaker: base {base}; train.py {' '.join(argv)}", flush=True)
        return main(argv)
    except SystemExit:  # --help; usage errors arrive as UsageError below
        raise
    except BaseException as e:
        if isinstance(e, UserError):
            reason = str(e)
        else:
            reason = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc().splitlines(True)[-6:])
        write_failure(output_dir, reason)
        print(f"error: {_redact(str(e))}", file=sys.stderr)
        sys.exit(1)
