"""lm-eval task YAMLs that read the local data mirror instead of the Hugging Face hub.

YAML cannot read environment variables, so the shipped files in `moebench/lmeval/tasks/` are
templates: `materialize(dest)` writes a ready include folder with the mirror's absolute paths filled
in (`@DATA_DIR@`), one `cmmlu_<subject>.yaml` per subject CSV found in the mirror and the `cmmlu`
group over them. Pass the folder to `lm_eval.tasks.TaskManager(include_path=...)` (or to lm-eval's
`--include_path` on the command line).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import yaml

from moebench.datasets import DatasetError, data_dir

TEMPLATES = Path(__file__).resolve().parent / "tasks"
PLACEHOLDER = "@DATA_DIR@"


def _yaml_str(text: str) -> str:
    """A double-quoted YAML scalar (JSON strings are valid YAML)."""
    return json.dumps(text, ensure_ascii=False)


def cmmlu_subjects(root: Path) -> list[str]:
    """Subject file stems present in <mirror>/cmmlu/test, sorted."""
    test_dir = root / "cmmlu" / "test"
    return sorted(p.stem for p in test_dir.glob("*.csv")) if test_dir.is_dir() else []


def shipped_task_names(root: Path | None = None) -> set[str]:
    """Task and group names the include folder defines for this mirror."""
    root = Path(root) if root is not None else data_dir()
    subjects = cmmlu_subjects(root)
    names = {"gsm8k"} if (root / "gsm8k" / "test.jsonl").is_file() else set()
    if subjects:
        names |= {"cmmlu"} | {f"cmmlu_{s}" for s in subjects}
    return names


def materialize(dest: str | Path, root: str | Path | None = None) -> Path:
    """Write the include folder for the mirror `root` (default: moebench's data mirror) into `dest`.

    Returns `dest`. Raises DatasetError when the mirror holds none of the shipped tasks' files.
    """
    root = Path(root) if root is not None else data_dir()
    root = root.resolve()
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    fill = json.dumps(str(root))[1:-1]     # escaped like the inside of a "..." YAML scalar
    wrote = []

    if (root / "gsm8k" / "test.jsonl").is_file() and (root / "gsm8k" / "train.jsonl").is_file():
        text = (TEMPLATES / "gsm8k.yaml").read_text(encoding="utf-8")
        (dest / "gsm8k.yaml").write_text(text.replace(PLACEHOLDER, fill), encoding="utf-8")
        wrote.append("gsm8k")

    subjects = cmmlu_subjects(root)
    if subjects:
        descriptions = yaml.safe_load((TEMPLATES / "cmmlu" / "subjects.yaml").read_text(encoding="utf-8"))
        cdir = dest / "cmmlu"
        cdir.mkdir(exist_ok=True)
        shutil.copyfile(TEMPLATES / "cmmlu" / "_default_template_yaml", cdir / "_default_template_yaml")
        for s in subjects:
            dev = root / "cmmlu" / "dev" / f"{s}.csv"
            if not dev.is_file():
                raise DatasetError(f"{dev} not found: cmmlu subject {s!r} has a test CSV but no dev CSV "
                                   f"for its 5-shot exemplars")
            # An unknown subject (a user-added CSV) gets a neutral description.
            desc = descriptions.get(s, "以下是单项选择题，请直接给出正确答案的选项。\n\n")
            (cdir / f"cmmlu_{s}.yaml").write_text(
                "include: _default_template_yaml\n"
                f"task: cmmlu_{s}\n"
                f"description: {_yaml_str(desc)}\n"
                "dataset_kwargs:\n"
                "  data_files:\n"
                f"    test: {_yaml_str(str(root / 'cmmlu' / 'test' / f'{s}.csv'))}\n"
                f"    dev: {_yaml_str(str(dev))}\n",
                encoding="utf-8")
        group = ["group: cmmlu", "task:"] + [f"  - cmmlu_{s}" for s in subjects] + [
            "aggregate_metric_list:",
            "  - aggregation: mean", "    metric: acc", "    weight_by_size: true",
            "  - aggregation: mean", "    metric: acc_norm", "    weight_by_size: true",
            "metadata:", "  version: 1.0", ""]
        (cdir / "_cmmlu.yaml").write_text("\n".join(group), encoding="utf-8")
        wrote.append("cmmlu")

    if not wrote:
        raise DatasetError(f"{root}: the data mirror holds neither gsm8k/test.jsonl+train.jsonl nor "
                           f"cmmlu/test/*.csv; set MOEBENCH_DATA_DIR to a mirror")
    return dest
