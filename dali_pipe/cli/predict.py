"""`python -m dali_pipe predict`: label images with a trained model, through the same DALI validation
pipeline as training. What --data can be: a folder of images (every image file under it), one image file,
a list file (one image path per line, relative to the list's folder or absolute), a manifest (a .tsv with an
image_path column, or a dataset folder holding dataset.tsv), or shards (a pack, or shards written by others,
with or without `cls`). Writes PRED/predictions.tsv, one row per readable image, named as --data names it;
unreadable ones go to PRED/bad_images.tsv instead of stopping the run."""
from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from model.loading import load_processor, load_trained

from ..config import Settings, SyncSettings
from ..datamodule import DaliDataModule
from ..errors import UserError
from ..forms import IMG_EXTENSIONS, LayoutError
from ..imagefolder import sync_image_folder
from ..inputs import detect, forms_text, object_hint
from ..loader import PipelineDecodeError
from ..manifest import MANIFEST_NAME, PathResolver, Sample, read_table, safe_relpath
from ..s3 import local_target
from ..scan import CACHE_NAME, scan, sniff, write_report
from ..shards.shardset import write_member_report
from ..spec import ImageSpec
from ..sync import sync
from ..tsv import row as tsv_row
from ..workdir import write_atomic
from .infer import prepared, run_model

IMAGE_EXTENSIONS = set(IMG_EXTENSIONS)  # torchvision's, as an ImageFolder lists them
TABLE_SUFFIXES = {".tsv", ".csv"}  # always read as a manifest (whose errors then say what is wrong)
LIST_SUFFIXES = {".txt", ".lst", ".list"}  # never taken for an image, whatever their first bytes


DECODE_FAILURES = 100  # images that may fail to decode in one predict run, each left out (a new pipeline after it)


class InputError(UserError):
    """--data names nothing to predict."""


def file_kind(path: Path) -> str:
    """What a file given as --data is: "image" (an image extension, or an image's first bytes outside a
    text file's name), "manifest" (a .tsv or .csv, or a first line that is a tab-separated header or names
    image_path), "binary" (NUL bytes in a file that is none of these, nor UTF-16 text) or "list" (any other
    text: one image path per line)."""
    suffix = path.suffix.lower()
    if suffix in IMAGE_EXTENSIONS:
        return "image"
    if suffix in TABLE_SUFFIXES:
        return "manifest"
    with open(path, "rb") as f:
        head = f.read(4096)
    if suffix not in LIST_SUFFIXES and sniff(head) is not None:
        return "image"
    if suffix not in LIST_SUFFIXES and is_binary(head):  # (its first bytes may hold a tab: no manifest either)
        return "binary"
    first = head.split(b"\n", 1)[0].removeprefix(b"\xef\xbb\xbf").strip().lower()
    return "manifest" if b"\t" in first or first == b"image_path" else "list"


UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")  # what PowerShell's `>` and Notepad's "Unicode" write first


def is_binary(head: bytes) -> bool:
    """Whether a file's first bytes are binary: NUL bytes, outside UTF-16 text (a list saved as UTF-16 is text,
    to be saved as UTF-8)."""
    return b"\x00" in head and not head.startswith(UTF16_BOMS)


def binary_problem(path: Path, head: bytes) -> str:
    if head.startswith(b"PAR1"):  # Parquet's magic: a Parquet file under another name (data.pq)
        return (f"--data {str(path)!r} is a Parquet file not named .parquet, which is how a Parquet --data is told; "
                f"rename it {path.stem}.parquet")
    return (f"--data {str(path)!r} is a file predict does not read (binary, not an image it knows); pass its folder "
            "if it is one file of a dataset, or --data may be: an image file, a list file of image paths (one per "
            "line), a .tsv manifest, or:" + forms_text("\n    "))


def read_list(path: Path) -> list[str]:
    """The image paths of a list file, one per line as written (padding spaces and blank lines dropped,
    a BOM and CRLF read as meant, a path listed twice kept once)."""
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        head = path.read_bytes()[:4096]
        if is_binary(head):  # binary: no list file, whatever else it is
            raise InputError(binary_problem(path, head)) from None
        utf16 = "UTF-16" if head.startswith(UTF16_BOMS) else f"{e.reason} at byte {e.start}"
        raise InputError(f"{path}: not UTF-8 text ({utf16}); a list file holds one image path per line: save it as "
                         "UTF-8") from None
    paths = [line.strip() for line in text.splitlines() if line.strip()]
    if not paths:
        raise InputError(f"{path}: lists no image path (one per line, relative to {path.parent} or absolute)")
    bad = next((n for n, line in enumerate(text.splitlines(), 1) if "\x00" in line), None)
    if bad is not None:
        raise InputError(f"{path}: line {bad} holds a NUL byte; a list file holds one image path per line")
    return list(dict.fromkeys(paths))


def list_images(data: str, cache_dir: str) -> tuple[Path, list[str]]:
    """(root, image paths relative to it, or absolute): a manifest's image_path rows (a dataset dir, a .tsv
    file or s3://bucket/prefix), one image file, a list file's lines, or every image file under a folder."""
    if data.startswith("s3://"):
        root = local_target(data, Path(cache_dir))
        form = detect(data, cache_dir)
        hint = object_hint(data) if form is None else ""
        if hint:  # (sync said "s3://b/hf/train.parquet/dataset.tsv does not exist; ... it must hold dataset.tsv")
            raise InputError(f"--data {data!r}: no object is under it as a prefix{hint}")
        if getattr(form, "name", None) == "imagefolder":  # class folders of images, no dataset.tsv
            return root, sync_image_folder(data, root, workers=SyncSettings.workers)[1]
        sync(data, root, workers=SyncSettings.workers, skip_missing=True)
        tsv = root / MANIFEST_NAME
    else:
        p = Path(data)
        if p.is_file():
            kind = file_kind(p)
            if kind == "image":
                return p.parent, [p.name]
            if kind == "list":
                return p.parent, read_list(p)
            if kind == "binary":
                with open(p, "rb") as f:
                    raise InputError(binary_problem(p, f.read(4)))
            root, tsv = p.parent, p
        elif (p / MANIFEST_NAME).is_file():
            root, tsv = p, p / MANIFEST_NAME
        elif p.is_dir():
            rels = sorted(str(f.relative_to(p)) for f in p.rglob("*")  # broken links too: the scan lists them
                          if f.suffix.lower() in IMAGE_EXTENSIONS and (f.is_file() or f.is_symlink())
                          and not f.name.startswith("."))
            if not rels:
                raise InputError(f"--data {data!r} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
            return p, rels
        else:
            raise InputError(f"--data {data!r} does not exist; pass a folder of images, an image file, a list file of "
                             "image paths (one per line), a .tsv manifest, or shards")
    df = read_table(tsv)
    if "image_path" not in df.columns:
        raise InputError(f"{tsv}: no 'image_path' column; add a header line with image_path")
    rels = []
    for p, line in zip(df["image_path"], df["_line"]):
        try:
            rels.append(safe_relpath(p, root))
        except ValueError as e:
            raise InputError(f"{tsv}: line {line}: {e}") from None
    return root, list(dict.fromkeys(rels))


def run(s: Settings) -> dict:
    s = prepared(s, s.predict.predict_output)
    out = Path(s.predict.predict_output)
    model = load_trained(s.model.model)
    dm = DaliDataModule(s.data, s.pipeline, ImageSpec.from_processor(load_processor(s.model.model)), out)

    try:
        form = detect(s.data.data, s.data.cache_dir)
    except LayoutError:  # a folder whose split folders training would refuse: predict labels every image in it
        form = None
    if form is not None and form.reader == "shards":
        dm.labels = False  # shards without cls (img2dataset, LAION) are labelled too
        return _predict_shards(s, dm, model, out)
    root, rels = list_images(s.data.data, s.data.cache_dir)
    resolver = PathResolver(root)
    paths = [resolver.absolute(r) for r in rels]
    result = scan(paths, s.data.scan if s.data.scan != "off" else "fast", max_pixels=s.data.max_pixels,
                  cache_path=Path(s.data.cache_dir) / CACHE_NAME)
    bad = {p: ("missing" if not os.path.lexists(p) else reason) for p, reason in result.bad.items()}
    write_report(bad, root.resolve(), out)
    good = [(r, p) for r, p in zip(rels, paths) if p not in bad]
    if not good:
        raise InputError(f"none of the {len(rels)} image(s) that --data {s.data.data!r} names is readable; see "
                         f"{out / 'bad_images.tsv'}")
    def listed(failed):
        write_report({**bad, **{p: reason for (_, p), reason in failed}}, root.resolve(), out)

    logits, done, failed = around_bad(
        s, model, good, lambda rest: dm.loader([Sample(p, i, i) for i, (_, p) in enumerate(rest)], training=False),
        lambda e, rest: next((k for k, (_, p) in enumerate(rest) if p == e.path), None), listed, by_label=True)
    bad.update({p: reason for (_, p), reason in failed})
    none_decoded(done, out)
    write_predictions(out, [r for r, _ in done], logits, model, s.predict.top_k)
    print(f"predict: {len(done)} image(s) labelled in {out / 'predictions.tsv'}"
          + (f"; {len(bad)} unreadable listed in {out / 'bad_images.tsv'}" if bad else ""))
    return {"predicted": len(done), "bad": len(bad)}


def none_decoded(done: list, out: Path) -> None:
    """Refuse a run in which DALI decoded none of the images (every one is listed in bad_images.tsv)."""
    if not done:
        raise InputError(f"DALI could decode none of the images; they are listed in {out / 'bad_images.tsv'}")


def around_bad(s: Settings, model, items: list, loader_for, failed_at, listed, *, by_label: bool,
               most: int = DECODE_FAILURES):
    """The model over `items` through `loader_for(items)`, in order; an item DALI cannot decode (one the checks
    before let through: --scan fast looks at headers) is left out and the run goes on after it, through a new
    pipeline over the rest, so every other item is labelled (at most `most` of them; then the error,
    which says to rerun with --scan full). `failed_at(error, rest)`: the failed item's position in `rest`;
    `by_label`: the loader's labels are positions in `rest` (files), else it yields `rest` in order (shards).
    `listed(failed)` writes bad_images.tsv with those left out so far, before the run ends either way.
    Returns (logits, the items labelled in their order, [(item, reason)] of those left out)."""
    import torch

    logits, done, failed, rest = [], [], [], list(items)
    while rest:
        got = []
        try:
            run_model(model, loader_for(rest), s.pipeline.device, s.model.precision, got=got)
            error = None
        except PipelineDecodeError as e:
            error = e
        n = sum(len(y) for _, y in got)
        ran = [rest[int(j)] for _, y in got for j in y.tolist()] if by_label else rest[:n]
        logits += [x for x, _ in got]
        done += ran
        if error is None:
            break
        k = failed_at(error, rest)
        if k is None or len(failed) >= most:
            if failed:
                listed(failed)  # what was found so far stays listed
            raise error
        failed.append((rest[k], f"DALI could not decode it{f' ({error.reason})' if error.reason else ''}"))
        print(f"predict: DALI {error.what}; left out (listed in bad_images.tsv), going on with the rest",
              file=sys.stderr)
        left = {id(x) for x in ran} | {id(rest[k])}
        rest = [x for x in rest if id(x) not in left]
    if failed:
        listed(failed)
    return (torch.cat(logits) if logits else None), done, failed


def _predict_shards(s: Settings, dm, model, out: Path) -> dict:
    """Every usable image of the shards (a pack's train and val, or shards written by others), named by
    its image_path in dataset.tsv (a pack) or its key; members the checks left out are listed in
    PRED/bad_images.tsv."""
    dm.data = dataclasses.replace(dm.data, max_bad_fraction=1.0)  # as for files: bad ones are listed, never a stop
    dm.prepare_data()  # fetch, index, check; PRED/bad_images.tsv
    shards = dm.manifest
    everything = shards.everything
    members = list(zip(shards.members(everything), shards.names(everything)))  # ((shard, entry), name), read order

    def loader_for(rest):
        excluded = everything.excluded | ({m for m, _ in members} - {m for m, _ in rest})
        return dm.loader(dataclasses.replace(everything, excluded=excluded, samples=len(rest)), training=False)

    def listed(failed):
        write_member_report(shards, out, extra=[(shards.shard_at(everything, m[0]), m[1], reason)
                                                for (m, _), reason in failed])

    logits, done, failed = around_bad(s, model, members, loader_for,
                                      lambda e, rest: next((k for k, (m, _) in enumerate(rest) if m == e.member), None),
                                      listed, by_label=False)
    none_decoded(done, out)
    write_predictions(out, [name for _, name in done], logits, model, s.predict.top_k)
    bad = len(shards.bad) + len(failed)
    print(f"predict: {len(done)} image(s) of the shards labelled in {out / 'predictions.tsv'}"
          + (f"; {bad} left out, listed in {out / 'bad_images.tsv'}" if bad else ""))
    return {"predicted": len(done), "bad": bad}


def write_predictions(out: Path, names: list[str], logits, model, top_k: int) -> None:
    """PRED/predictions.tsv: image_path, label, score, then label_2, score_2, ... (softmax scores)."""
    import torch

    k = min(top_k, logits.shape[1])
    scores, ids = torch.softmax(logits, 1).topk(k, dim=1)
    id2label = {int(i): v for i, v in model.config.id2label.items()}
    head = ["image_path", "label", "score"] + [f"{c}_{j}" for j in range(2, k + 1) for c in ("label", "score")]
    rows = [tsv_row(head)]
    for row, name in enumerate(names):
        cells = [name]
        for j in range(k):
            cells += [id2label.get(int(ids[row, j]), str(int(ids[row, j]))), f"{float(scores[row, j]):.6f}"]
        rows.append(tsv_row(cells))
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "predictions.tsv", "".join(rows))
