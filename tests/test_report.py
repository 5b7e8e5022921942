"""The HTML report on hand-written run and compare directories built from real GSM8K items."""
from __future__ import annotations

import json
import os
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from moebench.report import ReportError, render
from moebench.report import plots
from moebench.store.sections import per_side, speed_rows

DATA = Path(os.environ.get("MOEBENCH_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "datasets"))
GSM8K = DATA / "gsm8k" / "test.jsonl"
XSS = "<script>alert(1)</script>"

N_ITEMS = 12
BASE_WRONG = {9, 10, 11}
CAND_WRONG = {2, 5, 9, 11}          # loses 2 and 5, wins 10
CAND_ERROR = {7}                    # excluded from pairing


def gsm8k_items(n: int) -> list[dict]:
    if not GSM8K.is_file():
        pytest.skip(f"dataset mirror missing: {GSM8K}")
    out = []
    with GSM8K.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if i == n:
                break
            d = json.loads(line)
            out.append({"question": d["question"], "reference": d["answer"].split("####")[-1].strip()})
    return out


def manifest(label: str, model: str) -> dict:
    return {"schema_version": 1, "run_id": f"20250101T000000_quality_{label}", "label": label,
            "status": "complete", "started_at": "2025-01-01T00:00:00.000+00:00",
            "ended_at": "2025-01-01T00:12:00.000+00:00", "suite": {"name": "quality"},
            "runner": {"kind": "engine", "name": f"engine-{label}"},
            "model": {"path": f"models/zoo/{model}", "sha256": "ab" * 32},
            "build": {"moebench_version": "0.1.0", "git_rev": "a29fe80", "dirty": False},
            "host": {"cpu": "x86_64", "ram_gib": 24, "gpus": ["NVIDIA H200"]}}


def write_run(path: Path, label: str, wrong: set[int], errors: set[int], items: list[dict],
              poisoned: int | None = None) -> None:
    path.mkdir(parents=True)
    (path / "manifest.json").write_text(json.dumps(manifest(label, f"tiny-moe-{label}")), encoding="utf-8")
    with (path / "items.jsonl").open("w", encoding="utf-8") as f:
        for i, it in enumerate(items):
            rec = {"task": "gsm8k", "item_id": f"gsm8k/test/{i}", "question": it["question"],
                   "reference": it["reference"], "prompt_hash": f"h{i}"}
            if i in errors:
                rec.update(status="error", correct=None, answer=None, output="",
                           error="RunnerError: http://127.0.0.1:8080 connection reset")
            else:
                ok = i not in wrong
                answer = it["reference"] if ok else str(int(it["reference"].replace(",", "")) + 7)
                text = f"Let's think step by step. ... The answer is {answer}."
                if i == poisoned:
                    text = f"{XSS} The answer is {answer}."
                    answer = f"{answer}{XSS}"
                rec.update(status="ok", correct=ok, answer=answer, output=text)
            f.write(json.dumps(rec) + "\n")


def full_compare(tmp: Path) -> Path:
    items = gsm8k_items(N_ITEMS)
    write_run(tmp / "runs" / "bf16", "bf16", BASE_WRONG, set(), items)
    write_run(tmp / "runs" / "tiered", "tiered", CAND_WRONG, CAND_ERROR, items, poisoned=5)
    # Candidate NVML samples for the memory timeline (bytes, seconds, phase).
    rows = ["t_s,used_bytes,phase"]
    for k in range(60):
        phase = "load" if k < 10 else "prefill" if k < 25 else "decode" if k < 55 else "idle"
        rows.append(f"{k * 0.1:.1f},{(20 + min(k, 30) * 0.5) * 2**30:.0f},{phase}")
    (tmp / "runs" / "tiered" / "nvml_samples.csv").write_text("\n".join(rows) + "\n")
    # Baseline: Parquet samples on a monotonic clock, phases in the probe's separate marks file.
    import pandas as pd
    t0 = 5000.0
    pd.DataFrame({"time_s": [t0 + k * 0.1 for k in range(80)],
                  "used_bytes": [(22 + min(k, 40) * 0.45) * 2**30 for k in range(80)]}
                 ).to_parquet(tmp / "runs" / "bf16" / "nvml_samples.parquet")
    (tmp / "runs" / "bf16" / "nvml_phases.json").write_text(json.dumps(
        [{"phase": "load", "t": t0}, {"phase": "prefill", "t": t0 + 1.5}, {"phase": "decode", "t": t0 + 3.0},
         {"phase": "idle", "t": t0 + 7.5}]))
    paired = [i for i in range(N_ITEMS) if i not in CAND_ERROR]
    b_ok = sum(1 for i in paired if i not in BASE_WRONG)
    c_ok = sum(1 for i in paired if i not in CAND_WRONG)
    compare = {
        "baseline": {"run": str(tmp / "runs" / "bf16"), "label": "bf16"},
        "candidate": {"run": "../runs/tiered", "label": "tiered"},   # relative to the compare dir
        "tasks": {"gsm8k": {
            "n_paired": len(paired), "baseline_correct": b_ok, "candidate_correct": c_ok,
            "baseline_accuracy": b_ok / len(paired), "candidate_accuracy": c_ok / len(paired),
            "wins": ["gsm8k/test/10"], "losses": ["gsm8k/test/2", "gsm8k/test/5"],
            "excluded": ["gsm8k/test/7"], "flip_rate": 3 / len(paired), "mcnemar_p": 1.0,
            "delta_ci95": [-0.2727, 0.0909], "baseline_ci95": [0.5, 0.95], "candidate_ci95": [0.39, 0.89]}},
        "kld": {"n_tokens": 16256, "mean": 0.0312, "mean_err": 0.0004, "median": 0.0121, "p99": 0.41,
                "p999": 1.37, "p95": 0.12, "p90": 0.071, "p10": 0.0009, "p5": 0.0004, "p1": 0.00005,
                "p01": 0.000004, "max": 4.2, "min": 0.0, "same_top_p": 0.9431, "same_top_p_err": 0.0018,
                "delta_p": {"mean": -0.0021, "rms": 0.0412, "max": 0.61, "min": -0.72},
                "ln_ppl_ratio": 0.0187, "ppl_ratio": 1.0189,
                "histogram": {"edges": [0, 0.001, 0.01, 0.1, 1, 10], "counts": [2100, 7400, 5200, 1500, 56]},
                "per_chunk": [0.029, 0.033, 0.031, 0.035],
                "per_layer": {"router_agreement": [0.97, 0.91], "identical_set_share": [0.94, 0.83],
                              "kld": [0.011, 0.027]},
                "expert_usage": {"baseline": [[410, 120, 96, 300, 51, 77, 600, 130],
                                              [200, 220, 180, 260, 240, 190, 210, 200]]},
                "load_skew": {"baseline": [0.55, 0.31], "candidate": [0.58, 0.30]}},
        "needle": {"cells": [{"length": L, "depth": d, "prompt_tokens": L - 3,
                              "found_baseline": True, "found_candidate": not (L == 16384 and d == 0.5)}
                             for L in (4096, 8192, 16384) for d in (0.1, 0.5, 0.9)]},
        "speed": {"rows": [{"prompt_length": L,
                            "baseline": {"ttft_s": L / 9000, "prefill_tok_s": 9000.0, "decode_tok_s": 41.0},
                            "candidate": {"ttft_s": L / 7000, "prefill_tok_s": 7000.0, "decode_tok_s": 36.5},
                            "ratios": {"ttft_s": 9 / 7, "prefill_tok_s": 7 / 9, "decode_tok_s": 36.5 / 41}}
                           for L in (512, 2048, 8192)]},
        "memory": {"baseline": {"peak_used_bytes": 40 * 2**30, "min_free_bytes": 100 * 2**30,
                                "reserved_bytes": 615 * 2**20, "samples": 80,
                                "timeline": "nvml_samples.parquet"},
                   "candidate": {"peak_used_bytes": 35 * 2**30, "min_free_bytes": 105 * 2**30,
                                 "reserved_bytes": 615 * 2**20, "samples": 60, "timeline": "nvml_samples.csv"}},
        "energy": {"baseline": {"phases": {"prefill": {"joules": 812.5}, "decode": {"joules": 4410.0}},
                                "j_per_token_prefill": 0.012, "j_per_token_decode": 1.9,
                                "kwh_per_million_tokens": 0.41, "cost": {"day": 0.12, "night": 0.07}},
                   "candidate": {"phases": {"prefill": {"joules": 901.0}, "decode": {"joules": 4012.0}},
                                 "j_per_token_prefill": 0.013, "j_per_token_decode": 1.7,
                                 "kwh_per_million_tokens": 0.37, "cost": {"day": 0.11, "night": 0.06}}},
    }
    cdir = tmp / "compare"
    cdir.mkdir()
    (cdir / "compare.json").write_text(json.dumps(compare, indent=1), encoding="utf-8")
    return cdir


def svgs(html: str) -> list[ET.Element]:
    """Every inline SVG parsed as XML: a malformed plot fails here."""
    return [ET.fromstring(m) for m in re.findall(r"<svg\b.*?</svg>", html, flags=re.S)]


def rows_of_kind(html: str, kind: str) -> list[str]:
    return re.findall(rf'<tr class="{kind}" data-kind="{kind}">\s*<td>([^<]*)</td>', html)


def test_compare_report_has_every_section_and_escapes_model_text(tmp_path):
    cdir = full_compare(tmp_path)
    out = render(cdir)
    assert out == cdir / "report.html"
    html = out.read_text(encoding="utf-8")
    # self-contained: no external resources
    assert not re.search(r'<(link|img|iframe)\b|\bsrc=|https://', html)
    assert html.count("<script>") == 1                 # only the report's own filter script
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert XSS not in html
    # header: both labels, model identity, build
    for text in ("bf16", "tiered", "models/zoo/tiny-moe-tiered", "a29fe80", "NVIDIA H200"):
        assert text in html
    # flips: one win, two losses; the errored item is neither
    assert rows_of_kind(html, "win") == ["gsm8k/test/10"]
    assert rows_of_kind(html, "loss") == ["gsm8k/test/2", "gsm8k/test/5"]
    assert "gsm8k/test/7" not in rows_of_kind(html, "same-right") + rows_of_kind(html, "same-wrong")
    assert len(rows_of_kind(html, "same-right")) == 6 and len(rows_of_kind(html, "same-wrong")) == 2
    assert "Janet" in html                              # a real GSM8K question excerpt
    assert "wins (1)" in html and "losses (2)" in html and "flips (3)" in html
    assert "27.3%" in html                              # flip rate 3/11
    for section in ('id="accuracy"', 'id="kld"', 'id="needle"', 'id="speed"', 'id="memory"', 'id="energy"'):
        assert section in html
    assert "0.9431" not in html and "94.310%" in html   # same top p shown as a percentage
    assert "35.00 GiB" in html and "40.00 GiB" in html
    assert "lost by the candidate 1" in html
    parsed = svgs(html)
    # accuracy, histogram, per-chunk, 3 per-layer bars, usage heatmap, skew, needle, 3 speed, 2 memory
    assert len(parsed) == 14
    timelines = [s for s in parsed if s.get("aria-label") == "GPU memory used (GiB)"]
    assert len(timelines) == 2                           # one per run, each on its own clock
    for tl in timelines:
        titles = {t.text for t in tl.iter("{http://www.w3.org/2000/svg}title")}
        assert {"load", "prefill", "decode", "idle"} <= {t.split(":")[0] for t in titles}
        assert len(tl.findall("{http://www.w3.org/2000/svg}polyline")) == 1
    baseline_titles = {t.text for t in timelines[0].iter("{http://www.w3.org/2000/svg}title")}
    assert "decode: 3 to 7.5 s" in baseline_titles        # from nvml_phases.json, relative to the first sample
    # every filter bar points at a table that exists
    for table_id in re.findall(r'data-table="([^"]+)"', html):
        assert f'id="{table_id}"' in html


def test_compare_report_with_only_the_task_section_and_missing_runs(tmp_path):
    cdir = tmp_path / "cmp"
    cdir.mkdir()
    (cdir / "compare.json").write_text(json.dumps({
        "baseline": {"run": "/nonexistent/base", "label": "base"},
        "candidate": {"run": "gone/cand"},
        "tasks": {"cmmlu": {"n_paired": 40, "baseline_correct": 22, "candidate_correct": 19,
                            "wins": ["cmmlu/anatomy/3"], "losses": ["cmmlu/anatomy/1", "cmmlu/anatomy/8",
                                                                    "cmmlu/anatomy/30", "cmmlu/anatomy/31"]}},
    }), encoding="utf-8")
    out = render(cdir, out=tmp_path / "elsewhere" / "r.html")
    html = out.read_text(encoding="utf-8")
    assert out == tmp_path / "elsewhere" / "r.html"
    assert "not found" in html and "/nonexistent/base" in html
    assert "55.0%" in html and "47.5%" in html            # accuracies derived from counts
    assert "12.5%" in html                                # flip rate derived: 5 / 40
    assert rows_of_kind(html, "loss") == ["cmmlu/anatomy/1", "cmmlu/anatomy/8", "cmmlu/anatomy/30",
                                          "cmmlu/anatomy/31"]
    assert "no record in baseline, candidate" in html
    for section in ('id="kld"', 'id="needle"', 'id="speed"', 'id="memory"', 'id="energy"'):
        assert section not in html
    svgs(html)


def test_partial_optional_sections_render_what_is_there(tmp_path):
    cdir = tmp_path / "cmp"
    cdir.mkdir()
    (cdir / "compare.json").write_text(json.dumps({
        "baseline": {"run": "x"}, "candidate": {"run": "y"}, "tasks": {},
        "kld": {"mean": 0.5, "histogram": {"edges": [0, 1], "counts": [1, 2]},   # mismatched
                "per_layer": {"router_agreement": [0.9, None, 0.8]}, "expert_usage": {"baseline": [[]]}},
        "needle": {"cells": [{"length": 1024, "depth": 0.5}]},
        "speed": {"rows": [{"prompt_length": 128, "baseline": {"decode_tok_s": 10.0}}]},
        "memory": {"peak_used_bytes": 2**31, "timeline": "missing.parquet"},
        "energy": {"note": "NVML absent"},
    }), encoding="utf-8")
    html = render(cdir).read_text(encoding="utf-8")
    assert "histogram: edges and counts do not match" in html
    assert "memory timeline &#39;missing.parquet&#39; for the candidate run not found" in html
    assert "2.00 GiB" in html and "NVML absent" in html
    assert 'id="needle"' in html and "candidate found\n0" in html
    svgs(html)


def test_single_run_report(tmp_path):
    items = gsm8k_items(6)
    run = tmp_path / "run"
    write_run(run, "tiered", wrong={1, 4}, errors={3}, items=items, poisoned=4)
    html = render(run).read_text(encoding="utf-8")
    assert XSS not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "tiny-moe-tiered" in html and "complete" in html
    assert "60.0%" in html                               # 3 of 5 scored; the error is not a wrong answer
    assert "errors (1)" in html and "wrong (2)" in html and "correct (3)" in html
    assert "connection reset" in html
    assert len(rows_of_kind(html, "error")) == 1
    assert len(svgs(html)) == 1


def test_bad_inputs_name_the_file(tmp_path):
    with pytest.raises(ReportError, match="neither a compare directory"):
        render(tmp_path)
    (tmp_path / "compare.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ReportError, match=r"compare\.json: not valid JSON"):
        render(tmp_path)


def test_plots_escape_labels_and_parse():
    svg = plots.heatmap([[1, 2], [3, None]], ["<b>", "1"], ["a&b", "c"], "layer", "expert")
    el = ET.fromstring(svg)
    assert "<b>" not in svg and "&lt;b&gt;" in svg
    titles = [t.text for t in el.iter("{http://www.w3.org/2000/svg}title")]
    assert "layer 1, expert c: missing" in titles
    assert plots.nice_ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    ET.fromstring(plots.line_plot([("a", [128, 1024], [1, 2])], "x", "y", log_x=True))


def test_section_readers_accept_other_nestings():
    rows = speed_rows({"rows": [{"prompt_length": 256, "baseline_decode_tok_s": 20.0,
                                 "candidate_decode_tok_s": 15.0, "decode_ratio": 0.75},
                                {"prompt_length": 128, "decode_tok_s": {"baseline": {"median": 10.0},
                                                                        "candidate": {"median": 12.0}}}]})
    assert [r["prompt_length"] for r in rows] == [128, 256]
    assert rows[0]["decode_tok_s_ratio"] == pytest.approx(1.2)
    assert rows[1]["decode_tok_s_ratio"] == 0.75
    names, values = per_side({"peak_used_bytes": {"baseline": 1, "candidate": 2}, "samples": 5})
    assert values["baseline"]["peak_used_bytes"] == 1 and values["candidate"]["peak_used_bytes"] == 2
    assert values["value"]["samples"] == 5 and names == ["peak_used_bytes", "samples"]


def test_filter_script_is_valid_javascript(tmp_path):
    node = __import__("shutil").which("node")
    if node is None:
        pytest.skip("node not installed: cannot syntax-check the inline script")
    cdir = full_compare(tmp_path)
    html = render(cdir).read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", html, flags=re.S)
    assert len(scripts) == 1 and "querySelectorAll" in scripts[0]
    js = tmp_path / "filters.js"
    js.write_text(scripts[0], encoding="utf-8")
    r = __import__("subprocess").run([node, "--check", str(js)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def _probe_outputs(run_dir: Path, watts: float, peak_gib: float) -> dict:
    """NVML-shaped samples at 10 Hz written by the probe's own writer, and its summary for the manifest."""
    from moebench.probes.energy import energy_summary
    from moebench.probes.nvml import write_samples
    samples, counter_mj = [], 1e9          # the driver's cumulative counter, mJ since load
    for k in range(100):
        power = 80.0 if k < 10 else watts   # idle for the first second, then working
        samples.append({"t": k * 0.1, "mem_total_bytes": 141 * 2**30,
                        "mem_used_bytes": int(min(peak_gib, 4 + k * 0.5) * 2**30),
                        "mem_free_bytes": int((141 - min(peak_gib, 4 + k * 0.5)) * 2**30),
                        "mem_reserved_bytes": 615 * 2**20, "energy_mj": counter_mj, "power_instant_w": power})
        counter_mj += power * 100.0         # 0.1 s at `power` W
    phases = [{"phase": "baseline_idle", "t": 0.0}, {"phase": "load", "t": 1.0}, {"phase": "prefill", "t": 3.0},
              {"phase": "decode", "t": 4.0}, {"phase": "end", "t": 9.9}]
    write_samples(run_dir, samples, phases)
    summary = energy_summary(samples, phases, tokens={"prefill": 4096, "decode": 512},
                             tariffs={"day": 0.3, "night": 0.15, "currency": "EUR"})
    return {"nvml": {"available": True, "summary": summary}}


def _append_needle_and_speed(run_dir: Path, lost: set, decode_tok_s: float) -> None:
    with (run_dir / "items.jsonl").open("a", encoding="utf-8") as f:
        for L in (4096, 8192):
            for d in (0.25, 0.75):
                found = (L, d) not in lost
                f.write(json.dumps({"task": "needle", "item_id": f"needle/{L}/{d}", "status": "ok",
                                    "correct": found, "answer": "7319" if found else "1234",
                                    "reference": "7319", "output": "The code is 7319." if found else "1234",
                                    "length": L, "depth": d, "prompt_tokens": L - 5}) + "\n")
        for L in (512, 4096):
            for rep in range(3):
                ttft = L / 8000 * (1 + 0.01 * rep)
                f.write(json.dumps({"task": "speed", "item_id": f"speed/{L}/1/{rep}/0", "status": "ok",
                                    "correct": None, "answer": None, "reference": None, "output": "",
                                    "prompt_length": L, "clients": 1, "prompt_tokens": L, "output_tokens": 64,
                                    "ttft_s": ttft, "prefill_tok_s": L / ttft,
                                    "decode_tok_s": decode_tok_s * (1 - 0.01 * rep)}) + "\n")


def test_report_and_gate_on_a_compare_built_by_the_real_builder(tmp_path):
    """Runs -> moebench.compare.build -> compare.json -> report + gate: the shapes the pipeline writes."""
    build = pytest.importorskip("moebench.compare.build")
    from moebench.gate import run_gate
    items = gsm8k_items(N_ITEMS)
    base, cand = tmp_path / "bf16", tmp_path / "tiered"
    write_run(base, "bf16", BASE_WRONG, set(), items)
    write_run(cand, "tiered", CAND_WRONG, CAND_ERROR, items, poisoned=5)
    for run, watts, peak, lost, dec in ((base, 300.0, 40.0, set(), 40.0), (cand, 250.0, 30.0, {(8192, 0.75)}, 36.0)):
        _append_needle_and_speed(run, lost, dec)
        m = json.loads((run / "manifest.json").read_text())
        m["probes"] = _probe_outputs(run, watts, peak)
        (run / "manifest.json").write_text(json.dumps(m))
    compare = build.build_compare(base, cand)
    cdir = tmp_path / "cmp"
    cdir.mkdir()
    (cdir / "compare.json").write_text(json.dumps(compare, default=str))
    html = render(cdir).read_text(encoding="utf-8")
    assert XSS not in html
    # the needle task is scored too, so its lost cell is a loss of its own table
    assert rows_of_kind(html, "loss") == ["gsm8k/test/2", "gsm8k/test/5", "needle/8192/0.75"]
    assert rows_of_kind(html, "win") == ["gsm8k/test/10"]
    assert "gsm8k/test/7" in html and "error in candidate" in html          # excluded, with its reason
    assert "overall (all tasks)" in html
    assert "lost by the candidate 1" in html
    assert "40.00 GiB" in html and "30.00 GiB" in html                    # NVML peak used per side
    speed_table = html[html.index('id="speed"'):html.index('id="memory"')]
    assert "0.9" in speed_table                                           # decode ratio 36/40
    parsed = svgs(html)
    timelines = [s for s in parsed if s.get("aria-label") == "GPU memory used (GiB)"]
    assert len(timelines) == 2                                            # found from the probe's own files
    phases = {t.text.split(":")[0] for t in timelines[1].iter("{http://www.w3.org/2000/svg}title")}
    assert {"baseline_idle", "load", "prefill", "decode"} <= phases and "end" not in phases
    energy = html[html.index('id="energy"'):]
    assert "idle_power_w</td>" in energy and ">80<" in energy              # both runs idle at 80 W
    assert "net_j_per_token" in energy
    rules = tmp_path / "rules.toml"
    # three timed requests per side and length: min_samples = 3 lets them decide (the default, 5, would
    # call the speed rule inconclusive)
    rules.write_text("[gsm8k]\nmax_losses = 2\n[needle]\nmax_lost = 0\n[speed]\nmin_decode_ratio = 0.85\n"
                     "min_samples = 3\n[memory]\nmax_peak_used_ratio = 0.8\n")
    assert run_gate(cdir, rules) == 1
    summary = (cdir / "summary.md").read_text()
    assert "| gsm8k.max_losses | 2 | <= 2 | PASS |" in summary
    assert "| needle.max_lost | 1 | <= 0 | **FAIL** |" in summary
    assert "| memory.max_peak_used_ratio | 0.75 | <= 0.8 | PASS |" in summary
    assert "speed.min_decode_ratio | 0.9 [0.882, 0.9184] at 512 tokens, 1 client, n=3 | " \
           ">= 0.85 (95% interval) | PASS" in summary


GATE = {"verdict": "fail", "exit_code": 1, "rules_file": "gates/example.toml",
        "checks": [{"section": "gsm8k", "rule": "max_losses", "value": 2, "limit": "<= 1", "verdict": "fail",
                    "message": "gsm8k: 2 losses, more than 1"}]}


def test_report_opens_with_the_gate_read_from_gate_json(tmp_path):
    cdir = full_compare(tmp_path)
    (cdir / "gate.json").write_text(json.dumps(GATE), encoding="utf-8")
    html = render(cdir).read_text(encoding="utf-8")
    verdict = html[html.index('id="verdict"'):html.index('id="accuracy"')]
    assert '<div class="gate gate-fail"><b>Gate: FAIL</b> (exit code 1; rules from gates/example.toml)</div>' in verdict
    assert "<td>gsm8k.max_losses</td><td>2</td><td>&lt;= 1</td>" in verdict
    assert "<li>gsm8k: 2 losses, more than 1</li>" in verdict
    assert "No gate ran" not in html


@pytest.mark.parametrize("bad, says", [
    ({**GATE, "checks": [{k: v for k, v in GATE["checks"][0].items() if k != "limit"}]},
     "gate.json: checks[0]: missing key 'limit'"),
    ({k: v for k, v in GATE.items() if k != "rules_file"}, "gate.json: missing key 'rules_file'"),
    ({**GATE, "verdict": 1}, "gate.json: key 'verdict' should be a string, got int"),
    ({**GATE, "checks": ["gsm8k.max_losses"]}, "gate.json: checks[0] should be an object, got str"),
])
def test_a_malformed_gate_json_is_named_with_its_key_and_the_report_still_renders(tmp_path, bad, says):
    cdir = full_compare(tmp_path)
    (cdir / "gate.json").write_text(json.dumps(bad), encoding="utf-8")
    html = render(cdir).read_text(encoding="utf-8")
    from html import unescape
    warnings = [unescape(w) for w in re.findall(r'<div class="warn">([^<]*)</div>', html)]
    assert f"{cdir / says}" in warnings
    assert "Gate: " not in html and "No gate ran on this compare" in html
