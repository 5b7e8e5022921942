"""The engine's decode goals (docs/engine-speed.md), as rows from one call's results: decode_ab.py's
defaults and tiers_h200.py's tier plans. benchmarks/decode_goals.py prints them.
"""
from __future__ import annotations

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
