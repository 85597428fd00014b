"""What OUT holds, checked without torch (model/exported.py): a record that lacks the files an export writes
is not a finished model."""
from __future__ import annotations

import json

from helpers import copy_trained


def test_a_record_without_the_weights_or_a_json_file_is_not_this_runs_model(trained, tmp_path):
    """The session's export passes; the same record with model.safetensors (or label_map.json) left out of its
    files, every remaining checksum true, does not: the training command exports again instead of saying
    "nothing to do"."""
    from model.exported import problem, unlisted

    out = tmp_path / "out"
    copy_trained(trained, out, model_only=True)
    metrics = json.loads((out / "metrics.json").read_text())
    record = metrics["export"]
    where = {"run": record["run"], "global_step": record["global_step"], "select": record["select"]}
    assert problem(out, **where) is None and unlisted(record["files"]) == []
    for name in ("model.safetensors", "label_map.json"):
        files = {k: v for k, v in record["files"].items() if k != name}
        (out / "metrics.json").write_text(json.dumps({**metrics, "export": {**record, "files": files}}))
        assert problem(out, **where) == f"has a metrics.json whose record lists no {name} (written by an older " \
                                        "version, or damaged)"
    assert unlisted({"model.safetensors.index.json": {}, "config.json": {}, "preprocessor_config.json": {},
                     "label_map.json": {}}) == []  # a large model's shards: their index stands for the weights
