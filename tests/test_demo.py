"""`moebench demo` end to end (the README's main command): the engine on the trained zoo model, BF16
baseline against the tiered candidate (hot experts int8, cold ternary in host RAM), compare and report.
The candidate must visibly differ: non-zero KLD, router disagreement, and flips on every quality task
(the zoo fixture teaches the BF16 model part of the smoke items as near ties, so they can flip)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from conftest import CHECKOUT_TIERED_GROUP, moebench_cli, read_items
from moebench.zoo import fixture

pytestmark = pytest.mark.xdist_group(CHECKOUT_TIERED_GROUP)     # the demo repacks the checkout's tiered model


def test_demo_end_to_end(zoo, tmp_path):
    # From a folder of its own: the runs must read the models this demo built and packed, where the
    # shipped profiles look for them (the checkout's models/zoo), not whatever lies in the working folder.
    work = tmp_path / "elsewhere"
    work.mkdir()
    proc = moebench_cli("demo", "--out", str(tmp_path / "demo"), check=True, timeout=900, cwd=work)
    report = tmp_path / "demo" / "compare" / "report.html"
    assert proc.stdout.strip().splitlines()[-1] == str(report)
    [packed] = re.findall(r"packed to (\S+) in ", proc.stdout + proc.stderr)
    cmp = json.loads((tmp_path / "demo" / "compare" / "compare.json").read_text())
    models = {}
    for side in ("engine-bf16", "engine-tiered"):
        m = json.loads((tmp_path / "demo" / side / "manifest.json").read_text())
        assert m["status"] == "complete" and m["runner"]["kind"] == "engine"
        models[side] = Path(m["model"]["path"]).resolve()
    assert m["model"]["tiered"] is True
    packed = (work / packed).resolve()        # the demo's own words, relative to its working folder
    assert models["engine-tiered"] == packed
    assert models["engine-bf16"] == packed.parent / "tiny-moe"
    k = cmp["kld"]
    assert k["mean"] > 1e-3 and k["same_top_p"] < 1.0
    agreement = k["per_layer"]["router_agreement"]
    assert min(agreement) < 1.0, agreement           # the candidate routes differently somewhere
    assert agreement[0] == 1.0                         # ...but not before any expert was compressed
    skew = k["load_skew"]["baseline"]
    assert all(s > 0.3 for s in skew), skew            # busiest 25% of experts take well over 25%
    flips = {t: (v["wins"], v["losses"]) for t, v in cmp["tasks"].items()}
    for task in ("gsm8k", "humaneval", "cmmlu"):
        assert flips[task][0] or flips[task][1], flips
    # The baseline answers every item the fixture teaches.
    base = {r["item_id"]: r for r in read_items(tmp_path / "demo" / "engine-bf16")}
    assert all(base[k]["correct"] for k in fixture.taught_ids()), fixture.taught_ids()
    html = report.read_text()
    assert "router" in html.lower() and "<svg" in html
