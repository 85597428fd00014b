"""A thin, epoch-exact wrapper over DALIGenericIterator that yields `(images, labels)`.

The reader pads every shard to the same multiple of the batch size. DALI's DROP policy does not
consume that padded batch at the epoch end (the next epoch then starts with it), so both modes
use PARTIAL, which trims the padding exactly, and training keeps only the first
`(epoch_size // num_shards) // batch_size` full batches: the same count on every rank, each
rank dropping at most its one partial batch.

Lightning may stop iterating before an epoch ends (sanity-check validation, `max_steps`,
`limit_*_batches`). A DALI iterator abandoned mid-epoch would hand the rest of that epoch to the
next `iter()`, giving a short or doubled epoch (DALI issue #3865). This wrapper finishes an
abandoned epoch before starting the next one, so every `iter()` yields exactly `len()` batches.
"""
from __future__ import annotations

import re

from .errors import UserError
from .pipeline import READER_NAME


class PipelineDecodeError(UserError):
    """DALI failed on a file mid-epoch; the message names it when DALI does, and how to avoid it."""


class DaliLoader:
    def __init__(self, pipe, *, training: bool):
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self._it = DALIGenericIterator(
            [pipe], ["images", "labels"], reader_name=READER_NAME, auto_reset=True, prepare_first_batch=False,
            last_batch_policy=LastBatchPolicy.PARTIAL)
        self._open = False  # an epoch was started and not run to its end
        self.batch_size = pipe.max_batch_size
        meta = pipe.reader_meta(READER_NAME)
        self._len = ((meta["epoch_size"] // meta["number_of_shards"]) // self.batch_size if training
                     else len(self._it))

    def __len__(self) -> int:
        return self._len

    def _epoch(self):
        """The rest of DALI's current epoch. Uses next(), not iter(): DALI's __iter__ would try a
        reset, which it refuses (with a warning) mid-epoch."""
        while True:
            try:
                yield next(self._it)
            except StopIteration:  # auto_reset has rewound the iterator for the next epoch
                return

    def __iter__(self):
        if self._open:
            for _ in self._epoch():  # finish the abandoned epoch
                pass
        self._open = True
        try:
            for i, batch in enumerate(self._epoch()):
                if i < self._len:
                    out = batch[0]
                    yield out["images"], out["labels"].view(-1).long()
        except RuntimeError as e:
            if "Critical error in pipeline" not in str(e):
                raise
            m = re.search(r"Failed to decode sample #\d+ : (.+)", str(e))
            what = f"could not decode {m.group(1).strip()}" if m else "failed on a file of the current batch"
            raise PipelineDecodeError(
                f"DALI {what}. Rerun with --scan full: it decodes every file once before training, "
                "excludes the bad ones and lists them in OUTPUT/bad_images.tsv.") from None
        self._open = False
