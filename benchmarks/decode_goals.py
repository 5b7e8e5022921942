"""The engine's decode goals (docs/engine-speed.md) from one call's results: decode_ab.py's defaults
and tiers_h200.py's tier plans.

    python benchmarks/decode_goals.py --decode-ab $OUT/decode_ab_defaults.json --tiers $OUT/tiers_h200.json

Goals: bf16 at >= 65% of the roofline (bf16's bytes per step at the call's copy bandwidth); every
quantized GPU plan faster than bf16; both host plans at >= 70% of their tier-aware bound with the
engine runner's default settings (its prefetch from the attention input); an SSD plan at >= 60% of
its tier-aware bound, with its per-tier hit rates. Prints one row per goal and exits 1 when a goal
is missed or its figures are missing from the files.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GPU_PLANS = ("int4", "int8hot_ternarycold_gpu", "int8hot_ternary2cold_gpu", "int8hot_ternary2cold_gpu_a8")
HOST_PLANS = ("int8hot_ternarycold_host_randomhot", "int8hot_ternary2cold_host_a8")
SSD_PLANS = ("plan_gpu_host_ssd", "plan_gpu_host_ssd_guess", "plan_gpu_host_ssd_ahead")


def goals(ab: dict, tiers: dict) -> list[tuple[str, str, bool]]:
    """(goal, figures, met) rows; a missing figure is a row that is not met and says so."""
    rows = []
    v = ab.get("variants", {})
    roof = ab.get("bandwidth", {}).get("roofline_tok_s")
    bf16 = v.get("bf16", {}).get("tok_s")
    if bf16 and roof:
        rows.append(("bf16 >= 65% of the roofline",
                     f"{bf16:.2f} tok/s = {100 * bf16 / roof:.1f}% of {roof:.1f}", bf16 / roof >= 0.65))
    else:
        rows.append(("bf16 >= 65% of the roofline", "missing: bf16 rate or roofline_tok_s in decode_ab's file", False))
    for name in GPU_PLANS:
        rate = v.get(name, {}).get("tok_s")
        if rate and bf16:
            rows.append((f"{name} above bf16", f"{rate:.2f} tok/s ({100 * (rate / bf16 - 1):+.1f}%)", rate > bf16))
        else:
            rows.append((f"{name} above bf16", "missing", False))
    for name in HOST_PLANS:
        pct = v.get(name, {}).get("pct_of_tier_bound_prefetch_early")
        if pct is not None:
            r = v[name]
            rows.append((f"{name} >= 70% of its bound", f"{r['tok_s_prefetch_early']:.2f} tok/s = {pct:.1f}% of "
                         f"{r['tier_bound_tok_s']:.1f} (the runner's default prefetch)", pct >= 70))
        else:
            rows.append((f"{name} >= 70% of its bound", "missing", False))
    tv = tiers.get("variants", {})
    ssd = [(n, tv[n]) for n in SSD_PLANS if "pct_of_bound" in tv.get(n, {})]
    if not ssd:
        rows.append(("an SSD plan >= 60% of its bound", "missing: no SSD plan in the tiers file", False))
    for name, r in ssd:
        hits = r.get("hit_rates", {}).get("ssd", {})
        rates = ", ".join(f"{k} {100 * hits[k]:.1f}%" for k in ("gpu_cache_hits", "host_ram_cache_hits",
                                                               "read_from_disk") if hits.get(k) is not None)
        rows.append((f"{name} >= 60% of its bound", f"{r['tok_s']:.2f} tok/s = {r['pct_of_bound']:.1f}%; ssd picks: "
                     f"{rates}", r["pct_of_bound"] >= 60))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode-ab", type=Path, required=True, help="decode_ab.py's --out file (its defaults)")
    ap.add_argument("--tiers", type=Path, required=True, help="tiers_h200.py's tiers_h200.json")
    args = ap.parse_args(argv)
    loaded = []
    for path in (args.decode_ab, args.tiers):
        try:
            loaded.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as e:
            print(f"decode_goals: cannot read {path}: {e}", file=sys.stderr)
            return 2
    rows = goals(*loaded)
    ssd_met = any(met for goal, _, met in rows if goal.startswith("plan_gpu_host_ssd"))
    width = max(len(g) for g, _, _ in rows)
    for goal, figures, met in rows:
        is_ssd = goal.startswith("plan_gpu_host_ssd")
        mark = "met" if met else ("-" if is_ssd and ssd_met else "NOT MET")
        print(f"{goal:{width}s}  {mark:7s}  {figures}")
    # one SSD plan is enough; every other row must be met
    missed = [g for g, _, met in rows if not met and not (g.startswith("plan_gpu_host_ssd") and ssd_met)]
    print(f"goals: {'all met' if not missed else 'not met: ' + '; '.join(missed)}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
