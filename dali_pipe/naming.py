"""Our messages in the user's words: each message is written once, naming settings by their flags (--batch-size 64),
and `named` says it as the library's keywords (batch_size=64) or SageMaker's hyperparameters ("batch-size": 64).
"""
from __future__ import annotations

import re

from .config import FIELDS, flag_of

STYLES = ("flag", "keyword", "hyperparameter")  # how a user names settings: CLI, library, SageMaker


_FLAG_IN_TEXT = re.compile(r"(?<![\w-])(?P<flag>--[a-z][a-z0-9-]*)(?![\w-])(?P<colon>:)?"
                           r"(?P<value> (?:-?\d[\w.+-]*|'[^']*'|\([^()]*\)))?")


def named(text: str, style: str, names=None) -> str:
    """`text`, one of our messages, with the settings it names by their flags named as the user wrote them:
    "flag" leaves it as it is (--batch-size 64); "keyword" is the library's (batch_size=64, `scan='deep' is not
    one of ...`); "hyperparameter" is SageMaker's ("batch-size": 64). `names`: the settings to rename
    (default every one; a flag of no such setting stays). The messages are written once, with flags, and
    the library and the SageMaker entry say them in their users' words through this."""
    if style == "flag":
        return text
    flags = {flag_of(n): n for n in (FIELDS if names is None else names)
             if n in FIELDS and not FIELDS[n][1].metadata["positional"]}

    def say(m: re.Match) -> str:
        name = flags.get(m["flag"])
        if name is None:
            return m[0]
        value = (m["value"] or "").strip()
        switch = not value and not m["colon"] and FIELDS[name][2] is bool  # --skip-missing: a switch turned on
        if style == "keyword":
            return f"{name}={value}" if value else f"{name}=True" if switch else f"{name}:" if m["colon"] else \
                f"{name}="
        key = f'"{m["flag"][2:]}"'
        return f"{key}: {value}" if value else f'{key}: "true"' if switch else f"{key}:" if m["colon"] else key

    return _FLAG_IN_TEXT.sub(say, text)
