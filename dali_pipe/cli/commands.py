"""`python -m dali_pipe COMMAND`: the data commands, with flags generated from the settings; and
`python -m dali_pipe train FLAGS`, which is `python train.py FLAGS` (so the installed package trains
without the repository's train.py at hand)."""
from __future__ import annotations

import dataclasses
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..config import validate
from ..forms import names_a_file
from ..limits import tune_for_transfers
from ..s3 import ManifestMissing
from ..shards.format import PACKED_NAME
from ..shards.packsync import fetch_to
from ..stop import result
from ..sync import SyncStats, ask_listing, make_engine, read_object, sync
from ..tsv import MANIFEST_NAME
from . import NoDataError, command_imports, data_check, described
from . import main as train_main
from .infer import check_output
from .parser import add_subcommand, new_parser, parse, settings_from

SYNC_DOC = ("Download s3://bucket/prefix/dataset.tsv and every file it lists into LOCAL_DIR (for a pack, its "
            "packed.json, shards and index files, with parallel ranged GETs; for any other --data form, its files: "
            "class folders of images, WebDataset shards, a Hugging Face dataset's Parquet or save_to_disk files), "
            "so that LOCAL_DIR is then the same form. Files already present and unchanged "
            "(size + ETag) are skipped; each file is written under a temporary name and renamed when complete, so "
            "an interrupted sync can simply be rerun. Credentials, region and AWS_ENDPOINT_URL come from the "
            "standard AWS environment.")


COMMANDS = {  # the settings each command exposes: groups by name, single settings by flag
    "sync": ("sync", "--skip-missing"),
    "manifest": ("manifest",),
    "evaluate": ("eval", "--model", "--precision", "--data", "--cache-dir", "--batch-size", "--val-fraction", "--seed",
                 "--scan", "--max-pixels", "--max-bad-fraction", "--skip-missing", "--image-column", "--label-column", "--device",
                 "--num-threads"),
    "pack": ("pack", "--val-fraction", "--seed", "--scan", "--max-pixels", "--max-bad-fraction", "--skip-missing",
             "--image-column", "--label-column", "--cache-dir"),
    "predict": ("predict", "--model", "--precision", "--data", "--cache-dir", "--batch-size", "--scan", "--max-pixels",
                "--image-column", "--label-column", "--device", "--num-threads"),
}
MANIFEST_DOC = ("Write FOLDER/dataset.tsv as the ImageFolder at FOLDER implies it (the images of each class folder, "
                "as torchvision's ImageFolder lists them; a split column for train/ + val/ folders), for you to edit; "
                "training reads the folder the same way without it. Written atomically; an existing dataset.tsv is "
                "kept unless --force.")
PACK_DOC = ("Pack a dataset (SRC: any --data form, docs/data.md: class subfolders, a dataset.tsv folder, shards, a "
            "Hugging Face dataset; or s3://bucket/prefix of one) into WebDataset tar shards "
            "with DALI index files and a packed.json at DST (a folder or s3://bucket/prefix): bad images are "
            "left out (DST/bad_images.tsv), images larger than --max-side are downscaled, the train/val split is "
            "fixed. Deterministic and resumable (rerun after an interruption). Train with --data DST.")
EVALUATE_DOC = ("Evaluate a trained model (the folder train.py wrote) on a labelled dataset, through the same DALI "
                "validation pipeline as training: accuracy, top-5, loss, per-class precision/recall/F1 and the "
                "confusion matrix in OUTPUT/metrics.json, the matrix drawn in OUTPUT/confusion.png.")
PREDICT_DOC = ("Label images with a trained model: a folder of images (class subfolders too), one image file, a list "
               "file (one image path per line, relative to the list's folder or absolute), a dataset folder or .tsv "
               "manifest (image_path column; labels ignored), a pack or WebDataset shards, with or without cls (a "
               "folder, a shard file, a brace pattern, https:// URLs; rows named by their key), a Hugging Face "
               "dataset (Parquet, save_to_disk), or s3://bucket/prefix of one (docs/data.md). Writes "
               "OUTPUT/predictions.tsv (image_path, label, score and the next --top-k); unreadable images are listed "
               "in OUTPUT/bad_images.tsv.")
TRAINED = "the trained model: the folder train.py wrote (its --output), or a hub id of an image classifier; required"
HELPS = {  # where a command reads a setting otherwise than training does, its own help text
    "evaluate": {"data": "the labelled images, local or s3://bucket/prefix: class subfolders (ImageFolder), a "
                         "dataset.tsv folder, a pack, WebDataset shards (a folder, a shard file, a brace pattern, "
                         "https:// URLs; .tar, .tar.gz, .tgz), Parquet files or a save_to_disk folder of a Hugging "
                         "Face dataset (docs/data.md); required",
                 "model": TRAINED,
                 "val_fraction": "with no split column it decides which images are the val split; left out, the "
                                 "one training used (its model folder records it), else the default",
                 "seed": "with no split column it decides which images are the val split; left out, the one "
                         "training used (its model folder records it), else the default"},
    "predict": {"data": "what to label, local or s3://bucket/prefix: a folder of images (class subfolders too), an "
                        "image file, a list file of image paths (one per line), a dataset.tsv folder or .tsv "
                        "manifest, a pack, WebDataset shards with or without cls (a folder, a shard file, a brace "
                        "pattern, https:// URLs), Parquet files or a save_to_disk folder of a Hugging Face dataset "
                        "(docs/data.md); required",
                "model": TRAINED,
                "scan": "pre-flight image scan; predict always checks the headers (off reads as fast), and lists "
                        "unreadable images instead of stopping"},
    "pack": {"seed": "seed for the train/val split (without a split column) and the pack's sample order"},
}


def _download(s, missing: str) -> SyncStats:
    """The sync of a prefix holding neither dataset.tsv nor packed.json: the files of the form it holds (the
    registry's `download`), so that LOCAL_DIR is then that form; ManifestMissing where it holds none."""
    with command_imports():
        from ..inputs import S3Look, detect  # lazy: the registry loads numpy, which a dataset's sync never needs

    form = detect(s.sync.uri)
    if form is None:
        look = S3Look(s.sync.uri)
        if not look.names and not look.folders:
            raise ManifestMissing(f"{s.sync.uri} does not exist (no object under it); check the prefix"
                                  f"{names_a_file(s.sync.uri)}")
        raise ManifestMissing(f"{s.sync.uri} holds none of the input forms (no {missing}, no packed.json, no shards, "
                              "no Parquet or save_to_disk files, no class folders of images); check the prefix")
    if not s.sync.no_progress:
        print(f"sync: no {missing} there; the prefix holds {form.title}: syncing its files", file=sys.stderr)
    return form.download(s.sync.uri, Path(s.sync.local_dir), workers=s.sync.workers, progress=not s.sync.no_progress)


def parser():
    p = new_parser("python -m dali_pipe", "The commands of dali_pipe: train (python train.py) and the data commands.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("train", add_help=False, help="train a model: the same as python train.py, with its flags "
                                                 "(python -m dali_pipe train --help)")
    add_subcommand(sub, "sync", "download a dataset from S3 (only the files dataset.tsv lists), in parallel, resumably",
                   SYNC_DOC, COMMANDS["sync"])
    add_subcommand(sub, "manifest", "write the dataset.tsv an ImageFolder (class subfolders) implies, to edit it",
                   MANIFEST_DOC, COMMANDS["manifest"])
    add_subcommand(sub, "pack", "pre-resized WebDataset shards that DALI reads from disk or S3", PACK_DOC,
                   COMMANDS["pack"], HELPS["pack"])
    add_subcommand(sub, "evaluate", "metrics and a confusion matrix of a trained model on labelled data", EVALUATE_DOC,
                   COMMANDS["evaluate"], HELPS["evaluate"])
    add_subcommand(sub, "predict", "label images (a folder, a manifest or a pack) with a trained model", PREDICT_DOC,
                   COMMANDS["predict"], HELPS["predict"])
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["train"]:  # train.py's flags, its --help and its SageMaker contract (`train train`) alike
        train_main(argv[1:])
        return 0
    ns, problems = parse(argv, parser())
    command = ns.command
    del ns.command
    s = settings_from(ns)
    if command in ("evaluate", "predict") and not s.model.model:
        problems.append("--model: required: the folder a training run wrote (train.py's --output), or a hub id")
    if command in ("evaluate", "predict") and not s.data.data:
        problems.append(f"--data: required: {'the labelled images' if command == 'evaluate' else 'what to label'} "
                        "(see --help)")
    validate(s, COMMANDS[command], problems, data_check=data_check)
    if command == "sync":
        tune_for_transfers(one_arena=True)  # this process only moves bytes: glibc keeps what it frees for them
        engine = make_engine(s.sync.workers)  # one for the manifest or packed.json and the small files
        asking = ThreadPoolExecutor(1, thread_name_prefix="packed-json")
        try:
            # packed.json and the prefix's LIST are asked for beside the dataset's manifest: both syncs need the
            # LIST, and a pack's waits for no second round trip (a dataset's costs one small GET in parallel)
            packed = asking.submit(read_object, s.sync.uri, PACKED_NAME, engine)
            asked = ask_listing(engine, s.sync.uri)
            try:
                stats = sync(s.sync.uri, s.sync.local_dir, workers=s.sync.workers, skip_missing=s.data.skip_missing,
                             progress=not s.sync.no_progress, engine=engine, asked=asked)
            except ManifestMissing:
                raw = result(packed)  # looking at the stop's flag while it waits
                if raw is None:  # not a dataset.tsv folder nor a pack: another form, or none
                    stats = _download(s, MANIFEST_NAME)
                else:
                    if not s.sync.no_progress:
                        print(f"sync: no {MANIFEST_NAME} there, but a {PACKED_NAME}: syncing the pack", file=sys.stderr)
                    stats = SyncStats()
                    fetch_to(s.sync.uri, Path(s.sync.local_dir), mode="sync", workers=s.sync.workers,  # a pack's files
                             progress=not s.sync.no_progress, engine=engine, raw=raw, stats=stats, asked=asked)
                    if not s.sync.no_progress:
                        print(stats.summary(), file=sys.stderr)
        finally:
            asking.shutdown(wait=True, cancel_futures=True)  # before the engine it asks through
            engine.close()
        if s.sync.no_progress:
            print(stats.summary())
    elif command == "manifest":
        from ..imagefolder import write_manifest  # lazy: the listing's columns take numpy, which sync never needs

        path, rows, notes = write_manifest(s.manifest.folder, force=s.manifest.force)
        for note in notes:
            print(f"manifest: {note}", file=sys.stderr)
        print(f"manifest: wrote {path} ({rows} images); training now reads it instead of the folders")
    elif command == "pack":
        manifest = described(dataclasses.replace(s.data, data=s.pack.src), "SRC")  # before Lightning loads
        with command_imports():
            from .pack import run  # lazy: a command's module loads Lightning (~10 s); --help must answer at once

        run(s, manifest)
    elif command == "evaluate":
        check_output("evaluate", s.eval.eval_output, s.model.model)
        manifest = described(s.data)  # before torch and Lightning load: a data mistake is told at once
        with command_imports():
            from .evaluate import run  # lazy: as above

        run(s, manifest)
    elif command == "predict":
        check_output("predict", s.predict.predict_output, s.model.model)
        data = s.data.data
        if "://" not in data and "{" not in data and not os.path.lexists(data):  # told before torch loads (~5 s)
            raise NoDataError(f"--data {data!r} does not exist; pass a folder of images, an image file, a list file "
                              "of image paths (one per line), a .tsv manifest, or shards")
        with command_imports():
            from .predict import run  # lazy: as above

        run(s)
    return 0
