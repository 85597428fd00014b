"""`python -m dali_pipe evaluate`: a trained model on a labelled dataset, through the same DALI
validation pipeline as training; writes EVAL/metrics.json and EVAL/confusion.png."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from model import evaluation
from model.loading import load_processor, load_trained

from ..config import Settings
from ..datamodule import DaliDataModule
from ..errors import UserError
from ..manifest import Manifest, Sample
from ..pipeline import Shards
from ..redact import redact
from ..spec import ImageSpec
from .infer import prepared, run_model


class LabelError(UserError):
    """The dataset has labels the model does not know."""


def run(s: Settings, manifest: Manifest | None = None) -> dict:
    """Evaluate; `manifest`: the local dataset's, read already (cli.described), so it is not read again."""
    s = prepared(s, s.eval.eval_output)
    out = Path(s.eval.eval_output)
    model = load_trained(s.model.model)
    dm = DaliDataModule(s.data, s.pipeline, ImageSpec.from_processor(load_processor(s.model.model)), out,
                        manifest=manifest)
    dm.prepare_data()  # sync, scan, EVAL/bad_images.tsv
    manifest = dm.manifest
    test = getattr(manifest, "test", None)  # a Hugging Face dataset's test files, shards named test
    if s.eval.split == "test" and not test:
        raise UserError("--split test: --data has no test split (only a Hugging Face dataset's test-* files, or "
                        "shards named test beside others, make one); pass --split val, train or all")
    everything = getattr(manifest, "everything", None) or manifest.train + manifest.val  # shards: test files too
    samples = {"val": manifest.val, "train": manifest.train, "test": test, "all": everything}[s.eval.split]
    if not samples:
        raise UserError(f"--split {s.eval.split}: no images in it (no split column, and --val-fraction "
                        f"{s.data.val_fraction}); pass --split all, or the --val-fraction and --seed of training")
    label2id = {str(k): int(v) for k, v in model.config.label2id.items()}
    unknown = [c for c in manifest.classes if c not in label2id]
    if unknown:
        raise LabelError(f"--data has {len(unknown)} label(s) the model was not trained on: {unknown[:10]}; the "
                         f"model knows {len(label2id)} classes (config.json id2label)")
    remap = [label2id[c] for c in manifest.classes]
    if isinstance(samples, Shards):  # the pipeline maps the shards' class indices to the model's
        inner = samples.remap or tuple(range(len(remap)))  # cls integer -> class position, then -> the model's
        samples = dataclasses.replace(samples, remap=tuple(remap[c] if c >= 0 else -1 for c in inner))
    else:
        samples = [Sample(x.path, remap[x.label], x.line) for x in samples]
    logits, labels = run_model(model, dm.loader(samples, training=False), s.pipeline.device, s.model.precision)
    metrics = evaluation.compute(logits, labels, {int(k): v for k, v in model.config.id2label.items()})
    metrics.update(model=redact(s.model.model), data=redact(str(s.data.data)), split=s.eval.split)
    evaluation.write(metrics, out)
    print(evaluation.summary(metrics))
    print(f"evaluate: wrote {out / 'metrics.json'} and {out / 'confusion.png'}")
    return metrics
