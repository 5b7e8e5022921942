"""Answer extraction and comparison for generated answers (GSM8K numbers, multiple-choice letters)."""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# lm-eval's gsm8k filters: "strict-match" and "flexible-extract" (last match).
STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
DIGIT_RE = re.compile(r"[0-9]")


def normalize_number(text: str) -> str:
    """Remove `,` and `$` and a trailing `.`; then write numbers canonically ("1,234.00" -> "1234")."""
    s = text.strip().replace(",", "").replace("$", "")
    s = s.rstrip(".")
    try:
        d = Decimal(s)
    except InvalidOperation:
        return s
    if not d.is_finite():
        return s
    d = d.normalize()
    # Decimal("1E+3").normalize() prints in exponent form; write plain digits instead.
    return format(d, "f") if d != d.to_integral() else str(d.quantize(Decimal(1)))


def extract_gsm8k(output: str) -> tuple[str | None, str | None]:
    """(answer, method): the strict `#### N` first, else the last number in the text."""
    m = STRICT_RE.search(output)
    if m:
        return normalize_number(m.group(1)), "strict"
    found = FLEXIBLE_RE.findall(output)
    for groups in reversed(found):
        cand = next((g for g in groups if g), "")
        norm = normalize_number(cand)
        if DIGIT_RE.search(norm):
            return norm, "flexible"
    return None, None


def gsm8k_reference(answer_field: str) -> str:
    """The number after `####` in a GSM8K answer field."""
    if "####" not in answer_field:
        raise ValueError(f"GSM8K answer has no '####': {answer_field[-80:]!r}")
    return normalize_number(answer_field.split("####")[-1])


def numbers_equal(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return False
    if a == b:
        return True
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return False


def first_stop(text: str, stops: list[str]) -> int | None:
    """Index of the earliest stop sequence in `text`, or None (empty stop strings never match)."""
    first = None
    for s in stops:
        if s:
            i = text.find(s)
            if i != -1 and (first is None or i < first):
                first = i
    return first


def cut_at_stop(text: str, stops: list[str]) -> str:
    """Cut at the first stop sequence, in case a server returned text past it."""
    cut = first_stop(text, stops)
    return text if cut is None else text[:cut]


CHOICE_RE = re.compile(r"[ABCD]")


def first_choice_letter(output: str) -> str | None:
    """The first A-D letter in a generated answer (the fallback when no log-probs are available)."""
    m = CHOICE_RE.search(output)
    return m.group(0) if m else None
