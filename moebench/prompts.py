"""Prompt text that more than one package renders: the GSM8K and CMMLU tasks and the zoo fixture.

A leaf module (it imports nothing of moebench), so the zoo can build the exact prompts the tasks send
without importing the tasks, which import the runners, which import the zoo's tokenizer.
"""
from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Mapping


def gsm8k_question(question: str) -> str:
    """lm-eval's gsm8k doc_to_text."""
    return f"Question: {question}\nAnswer:"


def gsm8k_fewshot_prefix(exemplars: list[Mapping[str, str]]) -> str:
    """The exemplars as question, " " + worked answer, then the few-shot delimiter "\\n\\n"."""
    return "".join(f"{gsm8k_question(e['question'])} {e['answer']}\n\n" for e in exemplars)


def gsm8k_prompt(exemplars: list[Mapping[str, str]], question: str) -> str:
    """The whole prompt of one GSM8K item: the few-shot prefix, then the question."""
    return gsm8k_fewshot_prefix(exemplars) + gsm8k_question(question)


@lru_cache(maxsize=1)
def _lm_eval_descriptions() -> dict[str, str]:
    """CMMLU subject descriptions as lm-eval ships them (Chinese subject names); empty if lm-eval is absent."""
    try:
        import lm_eval
    except ImportError:
        return {}
    folder = Path(lm_eval.__file__).parent / "tasks" / "cmmlu"
    out = {}
    for f in folder.glob("cmmlu_*.yaml"):
        text = f.read_text(encoding="utf-8")
        name = re.search(r'"dataset_name":\s*"([^"]+)"', text)
        desc = re.search(r'"description":\s*"(.*)"', text)
        if name and desc:
            out[name.group(1)] = desc.group(1).encode().decode("unicode_escape").encode("latin-1").decode("utf-8")
    return out


def cmmlu_description(subject: str) -> str:
    return _lm_eval_descriptions().get(subject, f"以下是关于{subject.replace('_', ' ')}的单项选择题，请直接给出正确答案的选项。\n\n")


def cmmlu_question(row: dict[str, str]) -> str:
    return f"{row['Question'].strip()}\nA. {row['A']}\nB. {row['B']}\nC. {row['C']}\nD. {row['D']}\n答案："


def cmmlu_prefix(subject: str, dev: list[dict[str, str]]) -> str:
    """The subject description, then the dev exemplars with their answers (lm-eval's cmmlu format)."""
    return cmmlu_description(subject) + "".join(f"{cmmlu_question(r)} {r['Answer'].strip()}\n\n" for r in dev)
