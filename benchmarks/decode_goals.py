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

from moebench.bench.goals import goals

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
