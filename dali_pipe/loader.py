"""A thin, epoch-exact, resumable wrapper over DALIGenericIterator that yields `(images, labels)`.

Epoch-exact. Files: the reader pads every shard to the same multiple of the batch size. DALI's
DROP policy does not consume that padded batch at the epoch end (the next epoch then starts with
it), so both modes use PARTIAL, which trims the padding exactly, and training keeps only the first
`(epoch_size // num_shards) // batch_size` full batches: the same count on every rank, each rank
dropping at most its one partial batch. Shards: the epoch plan (dali_pipe/shards/plan.py) yields
those same counts itself, and marks the padding of a rank whose evaluation share is one short,
which this wrapper drops (`reader.valid`).

Lightning may stop iterating before an epoch ends (sanity-check validation, `max_steps`,
`limit_*_batches`). A DALI iterator abandoned mid-epoch would hand the rest of that epoch to the
next `iter()`, giving a short or doubled epoch (DALI issue #3865). This wrapper finishes an
abandoned epoch before starting the next one, so every `iter()` yields exactly `len()` batches.

Resumable. The pipeline is built with `enable_checkpointing=True`; `state()` returns DALI's
checkpoint of the reader position and every random generator (the iterator's counters included)
plus this wrapper's position in the epoch, and `restore(state)` rebuilds the pipeline from it. The
next `iter()` then continues the same epoch at the same batch, with the same augmentation draws,
as if nothing had happened. Lightning asks for batches one at a time when the length is known (no
fetch-ahead), so at a step boundary the DALI position is exactly the batches trained.
"""
from __future__ import annotations

import re

from .errors import UserError
from .pipeline import READER_NAME


class PipelineDecodeError(UserError):
    """DALI failed on a file mid-epoch; the message names it (DALI names a file it read; a shard's sample is
    found from the epoch plan), and how to avoid it. `path`: the file DALI named; `member`: (shard, entry) of
    the shard sample that failed; `what`: what failed, in words; `reason`: DALI's words."""

    def __init__(self, message: str, *, what: str = "", path: str | None = None,
                 member: tuple[int, int] | None = None, reason: str = ""):
        super().__init__(message)
        self.what, self.path, self.member, self.reason = what, path, member, reason


class ReaderChanged(Exception):
    """A saved loader position belongs to another reader than this version's (so the order restarts)."""


FILE_READER = "dali-file-reader/1"  # DALI's readers.file (also what states without a "reader" hold)
SHARD_READER = "shard-plan/1"  # dali_pipe/shards: the epoch plan through external_source


class DaliLoader:
    def __init__(self, build, *, training: bool):
        """`build(checkpoint)` returns a new (unbuilt) pipeline, restored from `checkpoint` when given."""
        self._build, self.training = build, training
        self._pos = 0  # batches yielded in the current epoch
        self._open = False  # an epoch was started and not run to its end
        self._resume = False  # restored mid-epoch: the next iter() continues that epoch
        self._it = None  # built at the first use, or by restore(): a resumed run builds its pipeline once

    def _ready(self) -> None:
        if self._it is None:
            self._make(None)

    @property
    def batch_size(self) -> int:
        self._ready()
        return self._batch_size

    def _make(self, checkpoint, reader_of_checkpoint: str | None = None) -> None:
        """Build the pipeline and its iterator, from `checkpoint` when given; with `reader_of_checkpoint`, a
        checkpoint of another reader than the one built is dropped and ReaderChanged raised after the build."""
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        pipe = self._build(checkpoint)
        reader = getattr(pipe, "shard_reader", None)
        self._reader = FILE_READER if reader is None else SHARD_READER
        if checkpoint is not None and reader_of_checkpoint not in (None, self._reader):
            self._make(None)
            raise ReaderChanged(f"the checkpoint's loader position was taken by {reader_of_checkpoint!r}, this "
                                f"version reads with {self._reader!r}")
        self._batch_size = pipe.max_batch_size
        if reader is not None:  # shards: the epoch plan yields exactly the batches kept, padding marked
            self._it = DALIGenericIterator([pipe], ["images", "labels"], auto_reset=True, prepare_first_batch=False)
            self._len, self._valid, self._member = reader.batches, reader.valid, reader.member
            return
        self._member = None
        self._it = DALIGenericIterator(
            [pipe], ["images", "labels"], reader_name=READER_NAME, auto_reset=True, prepare_first_batch=False,
            last_batch_policy=LastBatchPolicy.PARTIAL)
        meta = pipe.reader_meta(READER_NAME)
        self._len = ((meta["epoch_size"] // meta["number_of_shards"]) // self.batch_size if self.training
                     else len(self._it))
        self._valid = None

    def __len__(self) -> int:
        self._ready()
        return self._len

    # -- resume --------------------------------------------------------------------------------
    def state(self) -> dict:
        """Where this rank's loader stands: DALI's checkpoint plus the position in the epoch, and
        which reader took it (a checkpoint of another reader's graph cannot be restored)."""
        self._ready()
        return {"dali": self._it.checkpoints()[0], "pos": self._pos, "open": self._open, "reader": self._reader}

    def restore(self, state: dict) -> None:
        """Build (or rebuild) the pipeline from `state`; the next iter() continues where `state` was taken.
        Raises ReaderChanged for a state of another reader (an older version's shard reader), leaving the
        loader at its start."""
        self._make(state["dali"], state.get("reader", FILE_READER))
        self._pos, self._open, self._resume = state["pos"], state["open"], True

    # -- iteration -----------------------------------------------------------------------------
    def _epoch(self):
        """The rest of DALI's current epoch. Uses next(), not iter(): DALI's __iter__ would try a
        reset, which it refuses (with a warning) mid-epoch."""
        while True:
            try:
                yield next(self._it)
            except StopIteration:  # auto_reset has rewound the iterator for the next epoch
                return

    def __iter__(self):
        self._ready()
        resume, self._resume = self._resume, False
        if not (resume and self._open and self._pos < self._len):  # not a continuation: a fresh epoch
            if self._open:
                for _ in self._epoch():  # finish the abandoned (or fully yielded) epoch
                    pass
            self._pos = 0
        self._open = True
        try:
            for batch in self._epoch():
                if self._pos < self._len:
                    out = batch[0]
                    images, labels = out["images"], out["labels"].view(-1).long()
                    if self._valid is not None and self._valid(self._pos) < len(labels):  # drop the padding
                        n = self._valid(self._pos)
                        images, labels = images[:n], labels[:n]
                    self._pos += 1
                    # images (B,3,H,W) float on the pipeline's CUDA device ("gpu") or CPU; labels (B,) int64, same device
                    yield images, labels
        except RuntimeError as e:
            if "Critical error in pipeline" not in str(e):
                raise
            raise self._decode_error(str(e)) from None
        self._open, self._pos = False, 0

    def _decode_error(self, text: str) -> PipelineDecodeError:
        """DALI's critical error in words: the file it names, else the shard sample at that place of the batch
        that failed (the next one this loader yields; DALI reports an iteration's failure with its outputs)."""
        m = re.search(r"Failed to decode sample #(\d+) :[ \t]*(.*)", text)
        path = m.group(2).strip() if m and m.group(2).strip() else None
        member = self._member(self._pos, int(m.group(1))) if m and not path and self._member else None
        reason = next((line.strip() for line in text.splitlines() if "rror" in line and "pipeline" not in line
                       and "operator" not in line), "")
        if path:
            what = f"could not decode {path}"
        elif member is not None:
            what = f"could not decode {member[2]}"
        else:
            what = "failed on a file of the current batch"
        return PipelineDecodeError(
            f"DALI {what}. Rerun with --scan full: it decodes every file once before training, excludes the bad "
            "ones and lists them in OUTPUT/bad_images.tsv.", what=what, path=path, member=member and member[:2],
            reason=reason)
