"""Shared by the resume tests: a dataset whose label names the file, a tracer of every trained and
validated label, and a trigger that interrupts a run at a chosen point (SIGTERM or SIGKILL)."""
from __future__ import annotations

import json
import os
import signal
from collections import Counter
from pathlib import Path


def indexed_dataset(photo_root: Path, dest: Path, *, val_every: int | None = 7) -> Path:
    """The photos under `dest` (symlinks), each image its own class ('s007'), with a split column
    (every `val_every`-th image in val; None: no val rows)."""
    rows = (photo_root / "dataset.tsv").read_text().splitlines()[1:]
    dest.mkdir(parents=True, exist_ok=True)
    lines = ["image_path\tlabel\tsplit"]
    for i, rel in enumerate(rows):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        if not (dest / rel).exists():
            (dest / rel).symlink_to(photo_root / rel)
        split = "val" if val_every and i % val_every == 3 else "train"
        lines.append(f"{rel}\ts{i:03d}\t{split}")
    (dest / "dataset.tsv").write_text("\n".join(lines) + "\n")
    return dest


_ORIGINAL: dict = {}


def install(trace: Path, *, sigterm_at_step: int | None = None, sigterm_in_val_epoch: int | None = None,
            kill_at_step: int | None = None, patch=setattr, stop_signal: int = signal.SIGTERM) -> None:
    """Patch ImageClassifier (in this process) to append every batch's labels to `trace` (JSON lines)
    and to interrupt the run: `stop_signal` (SIGTERM, or SIGINT as Ctrl-C sends it) after a training step or
    during validation of an epoch, or SIGKILL. `patch` is setattr, or pytest's monkeypatch.setattr to undo
    it after the test."""
    from model.module import ImageClassifier

    if not _ORIGINAL:  # the unpatched steps, kept across installs (a second install must not wrap the first)
        _ORIGINAL.update(train=ImageClassifier.training_step, val=ImageClassifier.validation_step)
    train_step, val_step = _ORIGINAL["train"], _ORIGINAL["val"]

    def write(kind, module, labels):
        names = [module.classes[i] for i in labels.tolist()]
        with open(trace, "a") as f:
            f.write(json.dumps({"kind": kind, "epoch": module.current_epoch, "rank": module.global_rank,
                                "labels": names}) + "\n")

    def training_step(self, batch, batch_idx):
        write("train", self, batch[1])
        return train_step(self, batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        if not self.trainer.sanity_checking:
            write("val", self, batch[1])
            if sigterm_in_val_epoch == self.current_epoch and batch_idx == 0 and self.global_rank == 0:
                os.kill(os.getpid(), stop_signal)
        return val_step(self, batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        if self.global_rank == 0:
            if sigterm_at_step is not None and self.global_step == sigterm_at_step:
                os.kill(os.getpid(), stop_signal)
            if kill_at_step is not None and self.global_step == kill_at_step:
                os.kill(os.getpid(), signal.SIGKILL)

    patch(ImageClassifier, "training_step", training_step)
    patch(ImageClassifier, "validation_step", validation_step)
    patch(ImageClassifier, "on_train_batch_end", on_train_batch_end)


def read(trace: Path) -> list[dict]:
    return [json.loads(line) for line in trace.read_text().splitlines()]


def per_epoch(records: list[dict], kind: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for r in records:
        if r["kind"] == kind:
            out.setdefault(r["epoch"], []).extend(r["labels"])
    return out


def assert_each_sample_once_per_epoch(records: list[dict], *, train: set[str], epochs: int, batch: int,
                                      world: int = 1, val: set[str] | frozenset = frozenset()) -> None:
    """Every epoch: no training sample twice, all but at most one partial batch per rank trained,
    each validation sample exactly once; and no epoch replays another's order."""
    trained = per_epoch(records, "train")
    assert sorted(trained) == list(range(epochs)), sorted(trained)
    for e, seen in trained.items():
        twice = [k for k, n in Counter(seen).items() if n > 1]
        assert not twice, f"epoch {e + 1}: {len(twice)} sample(s) trained twice, e.g. {twice[:3]}"
        assert set(seen) <= train
        assert len(seen) == (len(train) // world) // batch * batch * world, (e, len(seen))
    firsts = [tuple(trained[e][:batch * 2]) for e in range(epochs)]
    assert len(set(firsts)) == epochs, "an epoch replayed another epoch's order"
    if val:
        validated = per_epoch(records, "val")
        for e in range(epochs):
            assert sorted(validated.get(e, [])) == sorted(val), f"epoch {e + 1}: validation not exactly once"
