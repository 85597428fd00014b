"""The SageMaker bring-your-own-container contract: `docker run IMAGE train`.

Maps /opt/ml (or $SAGEMAKER_BASE_DIR) onto train.py's settings and hands them to the same parser:
- input/config/hyperparameters.json: keys are the CLI flags ("batch-size", "batch_size" or
  "--batch-size"); values are strings, or JSON as framework estimators send them ("\\"tiny\\"",
  64, true, [0.35, 1.0]). Keys the SDK and tuning jobs add (`sagemaker_*`, `_tuning_objective_metric`
  and other `_`-prefixed ones) are ignored with one note; an unknown key is an error naming it and
  the closest flag; `null` is refused, naming the key.
- input/config/inputdataconfig.json: data from the `training` channel (input/data/training, File or
  FastFile mode), unless a `data` hyperparameter names an s3:// URI;
- input/config/resourceconfig.json: several hosts -> MASTER_ADDR (first host), NODE_RANK,
  --num-nodes, and all local GPUs;
- model/ gets the save_pretrained model + label map, output/tensorboard the logs,
  /opt/ml/checkpoints the spot-safe checkpoints (SageMaker syncs them to S3);
- any failure writes a short reason to output/failure (<= 1024 chars, redacted; a user error's
  message only, other failures their last traceback lines) and exits 1.
The sagemaker-training toolkit's SM_* variables are honoured as defaults.
"""
from __future__ import annotations

import difflib
import json
import os
import sys
import traceback
from pathlib import Path

from ..config import FIELDS, TRAIN_GROUPS, flag_of
from ..errors import UserError
from ..redact import redact, redact_argv

FAILURE_LIMIT = 1024
CONTRACT_FLAGS = ("--output", "--log-dir", "--checkpoint-dir")  # set by the contract, not by hyperparameters
INPUT_MODES = ("File", "FastFile")  # both put the channel under input/data/<channel>
CACHE_DIR = "input/data/dali_pipe_cache"  # under /opt/ml: the instance storage AWS documents for datasets


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


def _unwrap(value):
    """A hyperparameter value as the CLI wants it: framework estimators JSON-encode every value."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return value  # a plain string, as BYOC estimators send
    return value


def _as_args(value) -> list[str]:
    if isinstance(value, bool):
        return [str(value).lower()]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    return [str(value)]


def hyperparameter_argv(hp: dict) -> tuple[list[str], list[str]]:
    """(argv, ignored keys) from hyperparameters.json; every problem listed in one SageMakerError."""
    known = {flag_of(n) for n, (g, f, _) in FIELDS.items() if g in TRAIN_GROUPS and not f.metadata["positional"]}
    argv, ignored, problems = [], [], []
    for key, raw in hp.items():
        key = str(key)
        if key.startswith(("sagemaker_", "_")):
            ignored.append(key)
            continue
        flag = _flag(key)
        if flag in CONTRACT_FLAGS:
            problems.append(f"hyperparameter {key!r} is set by the SageMaker contract (model/, output/, "
                            "/opt/ml/checkpoints); remove it")
            continue
        if flag not in known:
            close = difflib.get_close_matches(flag, sorted(known), n=1)
            hint = f" (did you mean {close[0][2:]!r}?)" if close else ""
            problems.append(f"unknown hyperparameter {key!r}{hint}; the keys are train.py's flags "
                            "(python train.py --help). Pass secrets through the estimator's environment, "
                            "not hyperparameters.")
            continue
        value = _unwrap(raw)
        if value is None:
            problems.append(f"hyperparameter {key!r} is null; give it a value or remove it")
            continue
        argv += [flag, *_as_args(value)]
    if problems:
        raise SageMakerError("invalid hyperparameters:\n  " + "\n  ".join(problems))
    return argv, ignored


def build_argv(base: Path, extra: list[str], env: dict) -> tuple[list[str], dict]:
    """The train.py argv and the distributed environment for this host."""
    cfg = base / "input" / "config"
    hp = _read_json(cfg / "hyperparameters.json")
    if not isinstance(hp, dict):
        raise SageMakerError(f"{cfg / 'hyperparameters.json'} must hold a JSON object of flag -> value")
    channels = _read_json(cfg / "inputdataconfig.json")
    resources = _read_json(cfg / "resourceconfig.json")

    argv, ignored = hyperparameter_argv(hp)
    if ignored:
        print(f"sagemaker: ignoring {len(ignored)} key(s) set by SageMaker itself: {', '.join(sorted(ignored))}")
    given = {a for a in argv if a.startswith("--")}

    if "--data" not in given:
        channel = Path(env.get("SM_CHANNEL_TRAINING", base / "input" / "data" / "training"))
        if channels and "training" not in channels:
            raise SageMakerError(f"inputdataconfig.json has channels {sorted(channels)} but no 'training'; name the "
                                 "channel 'training' or pass a 'data' hyperparameter with an s3:// URI")
        mode = (channels.get("training") or {}).get("TrainingInputMode", "File")
        if mode not in INPUT_MODES:
            raise SageMakerError(f"the training channel uses TrainingInputMode {mode!r}; use File or FastFile "
                                 "(or pass a 'data' hyperparameter with an s3:// URI)")
        argv += ["--data", str(channel)]

    model_dir = Path(env.get("SM_MODEL_DIR", base / "model"))
    output_dir = Path(env.get("SM_OUTPUT_DATA_DIR", base / "output"))
    argv += ["--output", str(model_dir), "--log-dir", str(output_dir / "tensorboard"),
             "--checkpoint-dir", str(base / "checkpoints")]
    if "--cache-dir" not in given:
        argv += ["--cache-dir", str(base / CACHE_DIR)]

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


def write_failure(output_dir: Path, reason: str) -> None:
    output_dir.mkdir(parents=True, exist_ok=True)
    text = redact(reason.strip())
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
        print(f"sagemaker: base {base}; train.py {' '.join(redact_argv(argv))}", flush=True)
        return main(argv)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            raise
        write_failure(output_dir, "stopped by SIGTERM" if e.code == 143 else f"exited with status {e.code}")
        raise
    except BaseException as e:
        if isinstance(e, UserError):
            reason = str(e)
        else:
            reason = f"{type(e).__name__}: {e}\n" + "".join(traceback.format_exc().splitlines(True)[-6:])
        write_failure(output_dir, reason)
        print(f"error: {redact(e)}", file=sys.stderr)
        sys.exit(1)
