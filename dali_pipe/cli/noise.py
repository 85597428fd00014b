"""Messages a user can do nothing about, silenced where they come from (every command calls
`quiet_known_noise` before its heavy work)."""
from __future__ import annotations

import logging
import warnings


class _DropMessages(logging.Filter):
    def __init__(self, *needles: str):
        super().__init__()
        self.needles = needles

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.needles)


def quiet_known_noise() -> None:
    """Messages a user can do nothing about, silenced where they come from."""
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")  # Lightning on torch 2.13
    # our loader is resumable through the DataModule's state, which Lightning does not look at for this warning
    warnings.filterwarnings("ignore", message=r".*your dataloader is not resumable.*")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" / "Writing model shards" bars, one per save or load
    rank_zero = logging.getLogger("pytorch_lightning.utilities.rank_zero")
    if not any(isinstance(f, _DropMessages) for f in rank_zero.filters):
        rank_zero.addFilter(_DropMessages("litlogger"))  # an advertisement printed by every Trainer
