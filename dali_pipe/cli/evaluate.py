"""`python -m dali_pipe evaluate`: a trained model on a labelled dataset, through the same DALI
validation pipeline as training; writes EVAL/metrics.json and EVAL/confusion.png.

The split: a model folder that training wrote records how its validation split was made (metrics.json's
`split`: the rule, --val-fraction and --seed, and the data's identity). Without --val-fraction or --seed
given, evaluate takes those of training; given ones are honoured. Either way the data read is compared
with the recorded identity, and the summary says when the split is not the one the model validated
on, and why. A folder from before the record: the flags decide, as they always did, with a note."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from model import evaluation
from model.exported import training_metrics
from model.loading import load_processor, load_trained

from ..config import Settings, field_problems, flag_of, settings_from_keywords
from ..datamodule import DaliDataModule
from ..dataset import held_out_only
from ..errors import UserError
from ..manifest import Manifest, Sample
from ..redact import redact
from ..samples import Shards
from ..spec import ImageSpec
from .infer import prepared, run_model


class LabelError(UserError):
    """The dataset has labels the model does not know."""


SPLIT_FLAGS = ("val_fraction", "seed")  # the settings that decide a split made by rule "hash"


def trained_split(s: Settings) -> tuple[dict | None, str | None]:
    """(how the model's validation split was made, from its folder's metrics.json, or None; a note for a
    folder of ours written before it recorded that, or whose record is damaged). Fills --val-fraction and
    --seed from the record where they were not given."""
    metrics = training_metrics(s.model.model)
    if metrics is None:  # a hub id, or a folder another tool wrote: the flags decide, as always
        return None, None
    here = f"--val-fraction {s.data.val_fraction} and --seed {s.data.seed} decide it here; pass those of training"
    if "split" not in metrics:
        return None, (f"note: {redact(s.model.model)} does not record how its validation split was made (written "
                      f"by an older version): {here}")
    record, values, bad = metrics["split"], {}, []
    if not isinstance(record, dict) or not record:
        bad.append(f"{record!r:.60}")
    else:
        for name in SPLIT_FLAGS:
            if record.get(name) is not None:
                probe = settings_from_keywords({name: record[name]}, [name])  # checked as a flag's value is
                if field_problems(probe, [name]):
                    bad.append(f"{name}: {record[name]!r:.40}")
                else:
                    values[name] = getattr(probe.data, name)
        if not isinstance(record.get("samples"), str):
            bad.append(f"samples: {record.get('samples')!r:.40}")
    if bad:  # a record edited or damaged: named, and the flags decide (no claim about the data either way)
        return None, f"note: {redact(s.model.model)}/metrics.json's split record is damaged ({'; '.join(bad)}): {here}"
    for name, value in values.items():
        if name not in s.given:
            setattr(s.data, name, value)
    return record, None


def split_check(record: dict, s: Settings, digest: str) -> dict:
    """What evaluate read against the split the model validated on: the record, whether the data (its
    samples, labels and split) is the one training read, and the line the summary prints."""
    same = digest == record.get("samples")
    if same:
        how = str(record.get("made_by") or record.get("rule"))
        if record.get("rule") == "hash":
            how += f": --val-fraction {record.get('val_fraction')}, --seed {record.get('seed')}"
        line = f"split: as training made it, the one the model validated on ({how})"
    else:
        typed = [f"{flag_of(n)} {getattr(s.data, n)} (training: {record[n]})" for n in SPLIT_FLAGS
                 if n in s.given and n in record and getattr(s.data, n) != record[n]]
        why = ("; ".join(typed) if typed else "the data, its labels or the images the scan left out differ from "
               "what training read (or the split record in metrics.json was edited)")
        line = (f"note: this is not the split the model validated on: {why}. Some of these images may be ones "
                "it trained on")
    return {**record, "as_in_training": same, "line": line}


def run(s: Settings, manifest: Manifest | None = None) -> dict:
    """Evaluate; `manifest`: the local dataset's, read already (cli.described), so it is not read again."""
    s = prepared(s, s.eval.eval_output)
    out = Path(s.eval.eval_output)
    model = load_trained(s.model.model)
    split_before = (s.data.val_fraction, s.data.seed)
    record, note = trained_split(s)
    if (s.data.val_fraction, s.data.seed) != split_before:
        manifest = None  # read with the flags' split; the DataModule reads it again with training's
    dm = DaliDataModule(s.data, s.pipeline, ImageSpec.from_processor(load_processor(s.model.model)), out,
                        manifest=manifest)
    dm.prepare_data()  # sync, scan, EVAL/bad_images.tsv
    manifest = dm.manifest
    check = split_check(record, s, manifest.digest()) if record else None
    test = getattr(manifest, "test", None)  # a Hugging Face dataset's test files, shards named test
    if s.eval.split == "test" and not test:
        raise UserError("--split test: --data has no test split (only a Hugging Face dataset's test-* files, or "
                        "shards named test beside others, make one); pass --split val, train or all")
    everything = getattr(manifest, "everything", None) or manifest.train + manifest.val  # shards: test files too
    samples = {"val": manifest.val, "train": manifest.train, "test": test, "all": everything}[s.eval.split]
    if not samples and held_out_only(s.data.data, manifest):
        raise UserError(f"--split {s.eval.split}: " + held_out_only(s.data.data, manifest) + "; pass --split test")
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
    metrics.update(model=redact(s.model.model), data=redact(str(s.data.data)), split=s.eval.split,
                   val_fraction=s.data.val_fraction, seed=s.data.seed)
    if check:
        metrics["training_split"] = {k: v for k, v in check.items() if k != "line"}
    evaluation.write(metrics, out)
    print(evaluation.summary(metrics))
    for line in (check["line"] if check else None, note):
        if line:
            print(line)
    print(f"evaluate: wrote {out / 'metrics.json'} and {out / 'confusion.png'}")
    return metrics
