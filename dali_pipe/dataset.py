"""The data before its loaders: read (dataset.tsv, an ImageFolder tree, shards, tables), synced from S3,
scanned, reported, checked against the batch; and its identity, the data side of a run's fingerprint.

Nothing here loads torch, Lightning or DALI's pipelines (a scan that must decode loads DALI's decoder
itself), so the training command can decide what a rerun has to do (a finished run: "nothing to do")
before those load: cli/finished.py. DaliDataModule (datamodule.py) calls the same functions.
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

from .config import DataSettings, PipelineSettings, SyncSettings, recipe, recipe_names
from .errors import UserError
from .inputs import form_of
from .manifest import Manifest
from .scan import CACHE_NAME, ScanResult, scan, write_report
from .shards.shardset import ShardSet
from .shards.shardset import report as report_members
from .shards.verdicts import verify_local
from .workdir import OutputError


class ScanError(UserError):
    """Too many bad images; the message points at the report."""


class BatchTooLargeError(UserError):
    """The batch is larger than one rank's share of the training data."""


def read(data: DataSettings, *, labels: bool = True) -> Manifest | ShardSet:
    """The manifest of the (local) dataset (dataset.tsv, or an ImageFolder's class folders), split as the
    settings say; or the shards at --data (a pack, shards written by others, a Hugging Face dataset's
    tables), checked (shards/source.py, shards/tables.py; cached verdicts). `labels` False: shards without
    cls are read too (predict)."""
    return form_of(data).read(data, labels=labels)


def scan_manifest(manifest: Manifest, data: DataSettings, *, num_threads: int, progress: bool) -> ScanResult:
    """Scan every file of the manifest (verdicts cached under the cache dir)."""
    both = manifest.train + manifest.val
    return scan(both.paths, data.scan, max_pixels=data.max_pixels, num_threads=num_threads,
                cache_path=Path(data.cache_dir) / CACHE_NAME, progress=progress, stats=both.stats)


def missing_reasons(manifest: Manifest) -> dict[str, str]:
    """{absolute path: reason} for the files the manifest lists but the disk lacks (--skip-missing)."""
    root = manifest.root.resolve()
    return {str(root / rel): "missing on disk (listed in dataset.tsv; --skip-missing)" for rel in manifest.missing}


def report(manifest: Manifest, result: ScanResult, data: DataSettings, output: Path, *, empty: bool = True) -> None:
    """Write OUT/bad_images.tsv (bad and, with --skip-missing, missing files) and say what was excluded
    (`empty`: also when nothing was)."""
    if data.skip_missing and manifest.missing:
        print(f"--skip-missing: training without {len(manifest.missing)} listed file(s) that are missing, "
              f"e.g. {manifest.missing[0]!r}", file=sys.stderr)
    if not result.bad and not manifest.missing and (data.scan == "off" or not empty):
        return
    missing = missing_reasons(manifest)
    try:
        path = write_report({**result.bad, **missing}, manifest.root.resolve(), output)
    except OSError as e:
        raise OutputError(f"could not write {Path(output) / 'bad_images.tsv'} ({e.strerror or e}); free space there, "
                          "or pass another output (--output, or output= to DaliDataModule)") from None
    if result.bad or missing:
        print(f"scan: excluded {len(result.bad) + len(missing)} of {result.total + len(missing)} file(s); "
              f"reasons in {path}", file=sys.stderr)


def check_bad_fraction(result: ScanResult, data: DataSettings, output: Path) -> None:
    """Abort when more than --max-bad-fraction of the files are bad."""
    if result.total and len(result.bad) / result.total > data.max_bad_fraction:
        path, reason = next(iter(sorted(result.bad.items())))
        raise ScanError(f"{len(result.bad)} of {result.total} images are bad "
                        f"({len(result.bad) / result.total:.1%} > --max-bad-fraction {data.max_bad_fraction}), "
                        f"e.g. {path}: {reason}. See {output / 'bad_images.tsv'}; fix or remove them, or raise "
                        f"--max-bad-fraction to {enough_fraction(len(result.bad), result.total)} to train without "
                        "them.")


def enough_fraction(bad: int, total: int) -> str:
    """The shortest decimal at least bad / total (so that --max-bad-fraction of that value lets them pass)."""
    for digits in range(2, 10):
        text = f"{math.ceil(bad / total * 10 ** digits) / 10 ** digits:.{digits}f}".rstrip("0").rstrip(".")
        if float(text) >= bad / total and float(text) - bad / total < 0.01:
            return text
    return repr(bad / total)


def prepare(data: DataSettings, output: Path, *, num_threads: int, report_empty: bool = True, labels: bool = True,
            manifest: Manifest | None = None) -> tuple[Manifest, ScanResult]:
    """Once per node: sync s3:// data, scan, write the report, enforce --max-bad-fraction.
    Returns the manifest without the bad files, and the scan's result (`labels`: as for read). `manifest`: the
    local dataset's, already read (the CLI reads it before the heavy imports), so it is not read again."""
    form = form_of(data)
    if form.reader == "shards":  # fetch a pack, index others' shards, sync and check a Hugging Face dataset
        shards = form.prepare(data, num_threads=num_threads, workers=SyncSettings.workers, labels=labels)
        verify_local(shards.everything, data.cache_dir)  # size and checksum of every local shard, once
        report_members(shards, data.scan, output)
        result = shards.scan_result()
        check_bad_fraction(result, data, output)
        return shards, result
    if manifest is None:  # (a local dataset.tsv the CLI read before the heavy imports is not read again)
        manifest = form.prepare(data, num_threads=num_threads, workers=SyncSettings.workers, labels=labels)
    result = scan_manifest(manifest, data, num_threads=num_threads, progress=True)
    report(manifest, result, data, output, empty=report_empty)
    check_bad_fraction(result, data, output)
    return manifest.without(set(result.bad)), result


def data_line(manifest: Manifest | ShardSet, scan_mode: str, scan_result: ScanResult | None) -> str:
    """The data in one line: classes, the split's counts, what the scan excluded (and what the source notes)."""
    names = ", ".join(manifest.classes[:6]) + (", ..." if len(manifest.classes) > 6 else "")
    scan = (f"scan {scan_mode}: {len(scan_result.bad)} of {scan_result.total} excluded" if scan_result
            else f"scan {scan_mode}")
    unscanned = getattr(manifest, "unscanned", 0)  # streamed shards: their members are read as the epoch comes
    if unscanned:
        scan = (f"scan {scan_mode}: {len(scan_result.bad) if scan_result else 0} excluded; {unscanned} shard(s) "
                "streamed from S3 not scanned beforehand")
    return (f"data: {len(manifest.classes)} classes ({names}); {len(manifest.train)} train + {len(manifest.val)} val "
            f"images; {scan}" + (f"; {manifest.note}" if getattr(manifest, "note", "") else ""))


SPLIT_RULES = {"column": "the split column of dataset.tsv", "pack": "the pack's split (made when it was packed)",
               "folders": "the train/ and val/ folders (ImageNet's layout)",
               "names": "the shards or files named val or validation",
               "hash": "a hash of each sample's path or key with the val fraction and seed, per class"}


def split_record(manifest: Manifest | ShardSet, data: DataSettings, digest: str) -> dict:
    """How the validation split of a run was made, for the model folder: the rule (and in words), the val
    fraction and seed it took (they decide the split only for rule "hash"), the sample counts, and the
    data's identity (`digest`: its samples, labels and split; the run fingerprint's "samples")."""
    return {"rule": manifest.split_rule, "made_by": SPLIT_RULES[manifest.split_rule],
            "val_fraction": data.val_fraction, "seed": data.seed, "train": len(manifest.train),
            "val": len(manifest.val), "samples": digest}


def dropped_per_epoch(n: int, batch_size: int, num_shards: int) -> int:
    """Training images left out of each epoch: each rank keeps full batches of its share only."""
    return n - num_shards * ((n // num_shards) // batch_size) * batch_size


def drop_note(n: int, batch_size: int, num_shards: int) -> str | None:
    """One line when the dropped partial batches exceed 10% of the training images: how many, why, and
    the largest batch size up to this one that drops at most 10%; else None."""
    dropped = dropped_per_epoch(n, batch_size, num_shards)
    if not n or dropped <= 0.10 * n:
        return None
    better = next((b for b in range(batch_size - 1, 0, -1) if dropped_per_epoch(n, b, num_shards) <= 0.10 * n), None)
    steps = (n // num_shards) // batch_size
    fix = (f"; --batch-size {better} would drop {dropped_per_epoch(n, better, num_shards)}" if better else "")
    return (f"note: {dropped} of the {n} training images ({dropped / n:.0%}) are left out of every epoch: each of the "
            f"{num_shards} process(es) trains {steps} full batch(es) of {batch_size} and drops its partial batch (the "
            f"order changes every epoch, so a different {dropped} each time){fix}. Validation still sees every image.")


class NoTrainingError(UserError):
    """--data holds images, none of which training reads (a Hugging Face dataset of test files only)."""


def _files_of(manifest, split: str) -> str:
    """The data files holding the `split` rows of a table or shard manifest, for a message: "FILE" or "FILE and N
    more" (a shard's name is its file's, then " (row group G)" for a table)."""
    files = list(dict.fromkeys(s.name.split(" (", 1)[0] for s in manifest.shards if split in s.split))
    return files[0] + (f" and {len(files) - 1} more" if len(files) > 1 else "")


def held_out_only(data: str, manifest) -> str:
    """Where every image of --data is held out as test (a Hugging Face dataset whose files, or DatasetDict splits,
    are all named test): the files and what to do; '' otherwise. Training said "--batch-size 8 is larger than
    the 0 training images", evaluate --split val "no split column", and pack wrote an empty pack."""
    test = getattr(manifest, "test", None)
    if len(manifest.train) or len(manifest.val) or not test:
        return ""
    return (f"--data {data!r} holds only test files ({len(test)} images in {_files_of(manifest, 'test')}), which "
            "training and pack leave out and evaluate reads with --split test; to train on them, name them "
            "train-*.parquet (or save them as a DatasetDict's train split), with a validation-* file or none (then "
            "--val-fraction of the rows validate)")


def validation_only(data: str, manifest) -> str:
    """Where no image of --data trains because its files are all named validation (a Hugging Face dataset's
    validation-* files, one validation.parquet, shards named val): the files and what to do; '' otherwise.
    Training said "--batch-size 8 is larger than the 0 training images; add training images"."""
    if len(manifest.train) or not len(manifest.val) or getattr(manifest, "split_rule", None) != "names":
        return ""
    return (f"--data {data!r} holds only validation files ({len(manifest.val)} images in "
            f"{_files_of(manifest, 'val')}), which training validates on and trains on none; to train on them, rename them to names without a split word "
            "(then --val-fraction of the rows validate) or train-*, or add the training files beside them")


def no_training(data: str, manifest) -> str:
    """Why --data gives training no image, where its files' names say so (check_batch's `held_out`); '' otherwise."""
    return held_out_only(data, manifest) or validation_only(data, manifest)


def check_batch(n: int, batch_size: int, num_shards: int, held_out: str = "") -> None:
    """Training keeps full batches only: each rank's share must hold at least one. `held_out`: why there are
    none (held_out_only), said instead of the batch size."""
    if not n and held_out:
        raise NoTrainingError(held_out)
    if n // num_shards < batch_size:
        most = n // num_shards
        fix = f"pass --batch-size {most} or lower" if most else "add training images (or train on fewer processes)"
        raise BatchTooLargeError(f"--batch-size {batch_size} is larger than the {most} training "
                                 f"images each of the {num_shards} rank(s) gets; {fix}.")


def check_accumulation(n: int, batch_size: int, num_shards: int, grad_accum: int) -> None:
    """--grad-accum may not exceed the batches each rank trains per epoch: Lightning steps at an epoch's last
    batch, so each step would take that epoch's batches, not --grad-accum of them (and the start-up summary
    said 'x 16 accumulation = 128 per optimizer step' over 5 batches of 8)."""
    batches = (n // num_shards) // batch_size
    if 0 < batches < grad_accum:
        raise BatchTooLargeError(
            f"--grad-accum {grad_accum} is more than the {batches} batch(es) of {batch_size} each of the {num_shards} "
            f"process(es) trains per epoch ({n} training images): each optimizer step would accumulate those "
            f"{batches}, not {grad_accum} (Lightning steps at an epoch's end); pass --grad-accum {batches} or lower, "
            "or a smaller --batch-size")


FINGERPRINT_NAMES = {"samples": "the data (files, labels or split)", "classes": "the classes",
                     "image_size": "the image size", "world_size": "the number of "
                     "processes (the Trainer's devices x num_nodes)",
                     **{n: n for n in recipe_names(("data", "pipeline"))}}  # the keywords, as the library takes them

def differences(saved: dict, current: dict, names: dict = FINGERPRINT_NAMES,
                sides: tuple[str, str] = ("in the checkpoint", "now"), optional=frozenset()) -> list[str]:
    """What differs between two fingerprints, one line per field: 'LABEL: A SIDE0, B SIDE1'. `names`
    labels the fields (the library's words; the CLI passes its flags); a field in `optional` is compared
    only where both hold it (fields that older checkpoints lack)."""
    out = []
    for key, label in names.items():
        if key in optional and (key not in saved or key not in current):
            continue
        a, b = saved.get(key), current.get(key)
        if a != b:
            a, b = (_shown(key, v) for v in (a, b))
            out.append(f"{label}: {a} {sides[0]}, {b} {sides[1]}")
    return out


def _shown(key: str, value) -> str:
    if key == "classes" and isinstance(value, list):
        return f"{len(value)} classes ({', '.join(map(str, value[:4]))}{', ...' if len(value) > 4 else ''})"
    return repr(value)


def fingerprint(samples: str, classes: list[str], image_size: tuple[int, int], world_size: int,
                data: DataSettings, pipeline: PipelineSettings) -> dict:
    """The data side of a run's identity, what a resumed run must share with the checkpoint's: the data
    (`samples`: the files, labels and split, as the manifest's or shards' digest() hashes every sample), the
    classes, the model's input size, the number of processes, and the data and pipeline settings that change
    what the weights become (batch size, seed, crop and augmentations: config.py's identity=RECIPE)."""
    return {"samples": samples, "classes": list(classes), "image_size": list(image_size), "world_size": world_size,
            **recipe(data), **recipe(pipeline)}
