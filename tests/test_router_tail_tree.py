"""benchmarks/router_tail_tree.py: the copy's router runs as its source when MOEBENCH_ROUTER_TAIL is
unset, and under each cut writes the same logits while the experts get the fixed routes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton's first import (see kernels.py)
pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import json, os, torch
os.environ.setdefault("TRITON_INTERPRET", "1")
from moebench.engine import kernels
from moebench.engine.kernels import norm_router
g = torch.Generator().manual_seed(5)
x, d = torch.randn(2, 64, generator=g), torch.randn(2, 64, generator=g)
nw, rw = torch.rand(64, generator=g) + 0.5, torch.randn(12, 64, generator=g)
res, h, logits, ids, w = kernels.add_rmsnorm_router(x, d, nw, 1e-6, rw, 3, True)
want_ids, want_w = kernels.route_topk(logits, 3, True)
print(json.dumps({"path": norm_router.__file__, "logits": logits.tolist(), "ids": ids.tolist(), "w": w.tolist(),
                  "route_ids": want_ids.tolist(), "route_w": want_w.tolist(),
                  "arrivals": int(norm_router.shared_arrivals(x.device, kernels.norm_router.DEFAULT).abs().sum())}))
"""


def probe(tree: Path, cut: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MOEBENCH_ROUTER_TAIL"}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=str(tree), CUDA_VISIBLE_DEVICES="")
    if cut is not None:
        env["MOEBENCH_ROUTER_TAIL"] = cut
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, cwd=tree, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_router_tail_tree_cuts_only_the_tail(tmp_path):
    tree = tmp_path / "tail"
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "router_tail_tree.py"), "--src", str(ROOT),
                          "--out", str(tree)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    plain = probe(tree, None)
    assert plain["path"].startswith(str(tree))                  # the copy, not the checkout
    assert plain["ids"] == plain["route_ids"] and plain["arrivals"] == 0
    fixed = [[0, 5, 10], [3, 8, 1]]                              # 5p mod 12 for pairs 0..5
    for cut in ("full", "reload", "arrival", "none"):
        got = probe(tree, cut)
        third = float(torch.tensor(1 / 3, dtype=torch.float32))
        assert got["ids"] == fixed and got["w"] == [[third] * 3] * 2, cut
        assert got["arrivals"] == 0, cut
        if cut == "reload":       # the last program's reload is kept alive by a store of the row's max
            assert [r[0] for r in got["logits"]] == [max(r) for r in plain["logits"]]
            assert [r[1:] for r in got["logits"]] == [r[1:] for r in plain["logits"]]
        else:
            assert got["logits"] == plain["logits"], cut


def test_router_tail_tree_refuses_a_router_it_does_not_fit(tmp_path):
    src = tmp_path / "src"
    (src / "moebench" / "engine" / "kernels").mkdir(parents=True)
    (src / "moebench" / "engine" / "kernels" / "norm_router.py").write_text("# another router\n")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "router_tail_tree.py"), "--src", str(src),
                          "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "edit 0 does not fit" in run.stderr
