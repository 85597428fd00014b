"""Messages a user can do nothing about, silenced where they come from (every command calls
`quiet_known_noise` before its heavy work)."""
from __future__ import annotations

import logging
import threading
import warnings

from ..workdir import is_write_failure


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
    if not getattr(threading.excepthook, "ours", False):
        threading.excepthook = _thread_failure


_python_thread_hook = threading.excepthook


def _thread_failure(args) -> None:
    """TensorBoard's event-writer thread dies with a traceback when its folder refuses a write (read-only,
    gone, full); the training thread gets the same error at its next log call and the command names it in
    one line, so the thread's own traceback is only noise. Any other thread's failure prints as Python does."""
    if type(args.thread).__module__.startswith("tensorboard.") and isinstance(args.exc_value, OSError) and (
            is_write_failure(args.exc_value) or isinstance(args.exc_value, (FileNotFoundError, NotADirectoryError))):
        return
    _python_thread_hook(args)


_thread_failure.ours = True
