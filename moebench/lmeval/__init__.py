"""lm-evaluation-harness interoperability.

- `adapter.run_lm_eval(profile, tasks, limit, out_dir)`: lm-eval tasks on any moebench runner, stored
  as a moebench run (`adapter.RunnerLM` is the `lm_eval.api.model.LM` adapter).
- `importer.import_lm_eval(paths, out_dir)`: lm-eval `--log_samples` files into a moebench run.
- `local_tasks.materialize(dest)`: the shipped gsm8k/cmmlu task YAMLs pointed at the data mirror.

Submodules are imported on use: importing lm_eval costs seconds, and the importer does not need it.
"""
from __future__ import annotations

from typing import Any


def run_lm_eval(*args: Any, **kwargs: Any) -> Any:
    from moebench.lmeval.adapter import run_lm_eval as _run
    return _run(*args, **kwargs)


def import_lm_eval(*args: Any, **kwargs: Any) -> Any:
    from moebench.lmeval.importer import import_lm_eval as _import
    return _import(*args, **kwargs)
