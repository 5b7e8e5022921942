"""Keeping secrets out of profiles and out of runs.

Secrets come from the environment (`*_env = "VARNAME"` keys), never from files. Three guards, each
walking the whole profile (nested tables, arrays, `env`, `extra_body`, `args`):

- `literal_secrets`: key paths where a file holds a literal secret (a string under a secret-named key,
  or the value after a secret-named command-line flag); the profile is refused, naming each path.
- `redact`: a copy safe to write into a run: secret-named values and secret-shaped text (bearer
  tokens, `sk-`, `hf_`, GitHub and Slack tokens, AWS key ids) replaced by "***".
- `scrub`: removes the actual values of the environment variables a profile names, wherever they
  turn up in text written into the run (a server that echoes the API key in an error message).
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

MASK = "***"
# A key is secret-named when one of its words (split at non-letters and camelCase) is one of these.
SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "secrets", "password", "passwd", "pwd",
                          "auth", "authorization", "credential", "credentials", "cookie", "bearer"})
SECRET_SHAPES = re.compile(
    r"(?i:\bbearer\s+[A-Za-z0-9._~+/=-]{6,})"
    r"|\bsk-[A-Za-z0-9_-]{10,}"
    r"|\bhf_[A-Za-z0-9]{10,}"
    r"|\bgh[pousr]_[A-Za-z0-9]{20,}|\bgithub_pat_[A-Za-z0-9_]{20,}"
    r"|\bxox[abprs]-[A-Za-z0-9-]{10,}"
    r"|\bAKIA[0-9A-Z]{16}\b")


def _words(key: str) -> set[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", key)
    return {w.lower() for w in re.split(r"[^A-Za-z0-9]+", spaced) if w}


def is_secret_key(key: str) -> bool:
    """A key whose value would be a secret; `*_env` keys hold a variable's name, not its value."""
    words = _words(key.lstrip("-"))
    if words & {"env", "file", "path"}:     # names a variable or a file holding the secret, not the secret
        return False
    return bool(words & SECRET_WORDS)


def _is_secret_flag(item: Any) -> bool:
    return isinstance(item, str) and item.startswith("-") and "=" not in item and is_secret_key(item)


def literal_secrets(value: Any, path: str = "") -> list[str]:
    """Key paths (like `extra_body.auth.token`, `args[3]`) holding a literal secret."""
    found: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if is_secret_key(str(k)) and isinstance(v, str) and v.strip():
                found.append(sub)
            else:
                found += literal_secrets(v, sub)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            sub = f"{path}[{i}]"
            if i > 0 and _is_secret_flag(value[i - 1]) and isinstance(v, str) and not v.startswith("-"):
                found.append(sub)          # ["--api-key", "abc"]
            elif isinstance(v, str) and v.startswith("-") and "=" in v and is_secret_key(v.split("=", 1)[0]):
                found.append(sub)          # ["--api-key=abc"]
            else:
                found += literal_secrets(v, sub)
    return found


def redact(value: Any) -> Any:
    """A deep copy with secret-named values and secret-shaped text replaced by "***"."""
    if isinstance(value, dict):
        return {k: (MASK if is_secret_key(str(k)) and isinstance(v, str) and v else redact(v))
                for k, v in value.items()}
    if isinstance(value, list):
        out = []
        for i, v in enumerate(value):
            if i > 0 and _is_secret_flag(value[i - 1]) and isinstance(v, str):
                out.append(MASK)
            elif isinstance(v, str) and v.startswith("-") and "=" in v and is_secret_key(v.split("=", 1)[0]):
                out.append(v.split("=", 1)[0] + "=" + MASK)
            else:
                out.append(redact(v))
        return out
    if isinstance(value, str):
        return SECRET_SHAPES.sub(MASK, value)
    return value


def env_secret_values(value: Any) -> set[str]:
    """The values of every environment variable a profile names through a `*_env` key."""
    out: set[str] = set()
    if isinstance(value, dict):
        for k, v in value.items():
            if str(k).lower().endswith("_env") and isinstance(v, str):
                secret = os.environ.get(v)
                if secret and len(secret) >= 4:      # too short to scrub without mangling ordinary text
                    out.add(secret)
            else:
                out |= env_secret_values(v)
    elif isinstance(value, list):
        for v in value:
            out |= env_secret_values(v)
    return out


def scrub(text: str, secrets: set[str] | frozenset[str]) -> str:
    """`text` with every occurrence of each secret (raw or JSON-escaped) replaced by "***"."""
    for s in secrets:
        if s in text:
            text = text.replace(s, MASK)
        escaped = json.dumps(s)[1:-1]
        if escaped != s and escaped in text:
            text = text.replace(escaped, MASK)
    return text
