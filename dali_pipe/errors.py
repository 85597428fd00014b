"""The one base class for "the input or the settings are wrong", and the one for "the run failed".

Every module raises its own subclass (ManifestError, SyncError, ScanError, ModelLoadError,
UsageError, ...) with a message that names the file, row, flag or hyperparameter and the fix. The
CLIs catch `UserError` and print one clear line (exit status 2, or output/failure under
SageMaker) instead of a traceback. Importing this module is free, so the error handler never
delays `--help`.
"""
from __future__ import annotations


class UserError(Exception):
    """The input or the settings are wrong; the message says which and what to do."""


class RunFailed(Exception):
    """The run itself failed, not its input (training diverged), for a reason its message states in full with
    what to do: the CLIs print it as one line and exit with status 1 (output/failure under SageMaker)."""


class RunMismatchError(UserError):
    """A checkpoint to resume belongs to another run (other data, classes, model or batch size)."""


class DaliMissingError(UserError):
    """NVIDIA DALI cannot be imported: the project was installed without the DALI extra for this CUDA."""


def dali_missing(e: ImportError) -> DaliMissingError | None:
    """The user error for an ImportError of DALI itself (nvidia.dali not installed), else None (a broken
    install, or another module, is not this)."""
    name = getattr(e, "name", None) or ""
    if not (name in ("nvidia", "nvidia.dali") or name.startswith("nvidia.dali.")):
        return None
    return DaliMissingError("NVIDIA DALI is not installed in this Python (no module nvidia.dali): install the project "
                            "with the DALI extra for this machine's CUDA, pip install -e '.[cuda120]' (CUDA 12, as "
                            "the image) or -e '.[cuda130]' (CUDA 13); one DALI per environment")
