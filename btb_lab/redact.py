"""Credentials never reach a results directory: values of keys that look like secrets
(`token`, `api_key`, `secret`, `password`, …) are replaced by `***` in what a run stores
(the command line, the overrides, the resolved hypothesis) and so in every report and
log entry made from it."""

from __future__ import annotations

import re
from typing import Any

__all__ = [
    "REDACTED",
    "is_secret_key",
    "redact_argv",
    "redact_options",
    "redact_text",
    "redact_value",
]

REDACTED = "***"
# The last segment of a key or flag: HF_TOKEN, api_key, --api-key, db.password. Plural
# `tokens` (prefix_tokens, max_tokens) are token counts, not credentials.
_SECRET = re.compile(
    r"(?:^|[_.\-])(?:token|api[_\-]?key|key|secret|password|passwd|pwd|credentials?|auth"
    r"|authorization|cookie)$",
    re.IGNORECASE,
)


_WORDS = r"token|api[_\-]?key|key|secret|password|passwd|pwd|credentials?|auth|authorization|cookie"
# A secret key or flag inside free text (`[--api-key, sk-1]`, `{HF_TOKEN: x}`, `pwd=y`): the
# secret word starts a segment of the key and ends it; the value is the next bare word.
_IN_TEXT = re.compile(
    rf"(?<![\w.\-])((?:[\w.\-]*[_.\-])?(?:{_WORDS}))(?![\w])(\s*[=:,]\s*|\s+)([^\s,\]}}'\"]+)",
    re.IGNORECASE,
)


def is_secret_key(key: str) -> bool:
    """True for a key (or `--flag`) whose value is a credential."""
    return bool(_SECRET.search(key.strip().lstrip("-")))


def redact_value(value: Any) -> Any:
    """A copy of a JSON-like value with every secret key's value replaced, and in lists of
    arguments (`["--api-key", "x"]`, `["--token=x"]`) every secret flag's value too."""
    if isinstance(value, dict):
        return {
            k: REDACTED if isinstance(k, str) and is_secret_key(k) else redact_value(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return redact_argv([redact_value(v) for v in value])
    return value


def redact_options(value: Any) -> Any:
    """`redact_value` for the stored command-line options, whose strings (argv items,
    `--set` labels) may carry a secret inside the text."""
    value = redact_value(value)
    if isinstance(value, dict):
        return {k: redact_options(v) for k, v in value.items()}
    if isinstance(value, list):
        return [redact_options(v) for v in value]
    return redact_text(value) if isinstance(value, str) else value


def redact_text(text: str) -> str:
    """Free text (an argument, an override's label) with the value after every secret
    key or flag in it replaced."""
    return _IN_TEXT.sub(lambda m: f"{m.group(1)}{m.group(2)}{REDACTED}", text)


def redact_argv(argv: list[Any]) -> list[Any]:
    """Command-line arguments with credential values replaced: `KEY=VALUE` whose key's
    last dotted segment looks like a secret (`--set cluster.launch.env.C.HF_TOKEN=…`),
    `--flag=VALUE` and `--flag VALUE` for secret flags."""
    out: list[Any] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
            continue
        if not isinstance(arg, str):
            out.append(arg)
            continue
        parts = arg.split("=")
        secret = next(
            (i for i, key in enumerate(parts[:-1]) if is_secret_key(key.rsplit(".", 1)[-1])),
            None,
        )
        if secret is not None:  # KEY=VALUE, --flag=VALUE, --set=KEY=VALUE
            out.append("=".join(parts[: secret + 1]) + "=" + REDACTED)
        elif arg.startswith("-") and len(parts) == 1 and is_secret_key(arg):
            out.append(arg)
            hide_next = True
        else:
            out.append(redact_text(arg))
    return out
