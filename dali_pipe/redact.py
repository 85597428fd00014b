"""The one place that makes text safe to print or write: every printed argv, error, log line and
SageMaker's output/failure goes through `redact()`, and every value we write into a file that may
carry a user's path or URI (hyperparameters, checkpoint metadata, metrics) through `redact_tree()`.

Redacted:
- the value after a flag or key whose name looks secret (secret, token, password, passwd, key,
  credential, auth, session, signature): `--hf-token X`, `aws_secret_access_key=X`, `"token": "X"`,
  and a presigned URL's parameters (`X-Amz-Signature`, `X-Amz-Credential`, `X-Amz-Security-Token`,
  `Signature`);
- `user:pass@` in any URI;
- AWS access key ids (AKIA..., ASIA...) and 40-character secret-key-like strings;
- Hugging Face tokens (`hf_...`), also inside a path or a name (`/models/my_hf_...`).

`RedactingStream` wraps stdout/stderr in the CLI so that nothing printed, by us or by a library,
carries one of these.
"""
from __future__ import annotations

import io
import re

MASK = "[redacted]"
_NAME = r"[A-Za-z0-9_.-]*(?:secret|token|passw(?:or)?d|key|credential|auth|session|signature)[A-Za-z0-9_.-]*"
_PATTERNS = [
    # --flag value / --flag=value with a secret-looking flag name
    (re.compile(rf"(--{_NAME})(=|\s+)(?!--)(\S+)", re.I), lambda m: f"{m.group(1)}{m.group(2)}{MASK}"),
    # "key": "value" (JSON) and key=value / key: value
    (re.compile(rf"""(["']?{_NAME}["']?\s*[:=]\s*)("[^"]*"|'[^']*'|[^\s,;&}}]+)""", re.I),
     lambda m: f"{m.group(1)}{MASK}"),
    (re.compile(r"([a-z][a-z0-9+.-]*://)[^/\s:@]+:[^/\s@]+@", re.I), lambda m: f"{m.group(1)}{MASK}@"),
    (re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA)[A-Z0-9]{16}\b"), lambda m: MASK),
    (re.compile(r"(?<![A-Za-z0-9])hf_[A-Za-z0-9]{20,}"), lambda m: MASK),
    # a 40-character AWS secret key: base64 alphabet with both cases (not a hex digest)
    (re.compile(r"(?<![A-Za-z0-9/+=])(?=[A-Za-z0-9/+=]*[a-z])(?=[A-Za-z0-9/+=]*[A-Z])[A-Za-z0-9/+=]{40}"
                r"(?![A-Za-z0-9/+=])"), lambda m: MASK),
]


def redact(text: str) -> str:
    """`text` with every secret-looking value replaced by [redacted]."""
    text = str(text)
    for pattern, repl in _PATTERNS:
        text = pattern.sub(repl, text)
    return text


def redact_tree(value):
    """`value` (nested dicts, lists, tuples, dataclasses as dicts) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_tree(v) for v in value)
    return value


def redact_argv(argv: list[str]) -> list[str]:
    """An argv list with the values of secret-looking flags masked (for printing)."""
    return redact(" ".join(argv)).split(" ")


class RedactingStream(io.TextIOBase):
    """A text stream that redacts every line before passing it on (stdout/stderr in the CLI).

    Text is held until a newline or carriage return, so a secret split over two writes is still
    seen whole; progress bars (which end their frames with '\\r') keep redrawing in place."""

    def __init__(self, stream):
        self._stream, self._pending = stream, ""

    def write(self, text: str) -> int:
        self._pending += text
        cut = max(self._pending.rfind("\n"), self._pending.rfind("\r"))
        if cut >= 0:
            self._stream.write(redact(self._pending[:cut + 1]))
            self._pending = self._pending[cut + 1:]
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(redact(self._pending))
            self._pending = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return self._stream.isatty()

    def fileno(self) -> int:
        return self._stream.fileno()

    @property
    def encoding(self):
        return getattr(self._stream, "encoding", "utf-8")

    def writable(self) -> bool:
        return True
