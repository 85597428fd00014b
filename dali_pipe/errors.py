"""The one base class for "the input or the settings are wrong".

Every module raises its own subclass (ManifestError, SyncError, ScanError, ModelLoadError,
UsageError, ...) with a message that names the file, row, flag or hyperparameter and the fix. The
CLIs catch `UserError` and print one clear line (exit status 2, or output/failure under
SageMaker) instead of a traceback. Importing this module is free, so the error handler never
delays `--help`.
"""
from __future__ import annotations


class UserError(Exception):
    """The input or the settings are wrong; the message says which and what to do."""


class RunMismatchError(UserError):
    """A checkpoint to resume belongs to another run (other data, classes, model or batch size)."""
