"""A copy of a moebench tree whose fused router can cut its tail, for decode_ab.py: what the router's
arrival counter, logit reload and softmax + top-k cost a decode step.

    python benchmarks/router_tail_tree.py --src . --out .wt/tail
    for cut in full reload arrival none; do
        MOEBENCH_ROUTER_TAIL=$cut python benchmarks/decode_ab.py --tree .wt/tail --variants bf16 --out $OUT/tail_$cut.json
    done
    python benchmarks/decode_ab.py --tree . --variants bf16 --out $OUT/head.json    # the real router

Under MOEBENCH_ROUTER_TAIL the experts read fixed routes (pair p's expert is 5p mod E, weight
1 / k; the same bytes per step as real routes, other tokens), and add_rmsnorm_router_kernel runs:
  full     its whole tail (arrival, the last program's reload, softmax + top-k), writing its routes
           to scratch buffers: against the real router, what routing the experts by it costs;
  reload   the arrival counter and the last program's reload of the logits, no softmax or top-k;
  arrival  the arrival counter alone (each token's last program resets it);
  none     no arrival and no tail: the logits only.
Unset, the copy runs as its source; a cut runs the arrival counter's path (router_poll's mailbox off). The
copy is made by exact text edits of
moebench/engine/kernels/norm_router.py; a source those edits no longer fit is refused.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

EDITS = [
    ("MAIL_EMPTY = 0x7FBADBAD\n",
     "MAIL_EMPTY = 0x7FBADBAD\n_FIXED_ROUTES: dict = {}\n"),
    ("QB: tl.constexpr, EARLY: tl.constexpr = False, mail_ptr=None,",
     "QB: tl.constexpr, EARLY: tl.constexpr = False, TAIL: tl.constexpr = 0, mail_ptr=None,"),
    ("""            else:
                route_when_last_arrives(logits_ptr, count_ptr, ids_ptr, w_ptr, t, E, n_blocks, TOPK, KP, NORM,
                                        BLOCK_E)
""",
     """            elif TAIL == 0 or TAIL == 1:
                route_when_last_arrives(logits_ptr, count_ptr, ids_ptr, w_ptr, t, E, n_blocks, TOPK, KP, NORM,
                                        BLOCK_E)
            elif TAIL == 2 or TAIL == 3:
                last = tl.atomic_add(count_ptr + t, 1, sem="acq_rel")
                if last == n_blocks - 1:
                    if TAIL == 2:
                        lo = tl.arange(0, BLOCK_E)
                        zl = tl.load(logits_ptr + t * E + lo, mask=lo < E, other=float("-inf"), cache_modifier=".cg")
                        tl.store(logits_ptr + t * E, tl.max(zl, axis=0))
                    tl.atomic_xchg(count_ptr + t, 0)
"""),
    ("""    w = torch.empty(N, top_k, dtype=torch.float32, device=x.device)
    # router_topk's launch config""",
     """    w = torch.empty(N, top_k, dtype=torch.float32, device=x.device)
    import os
    tail = {"": 0, "full": 1, "reload": 2, "arrival": 3, "none": 4}[os.environ.get("MOEBENCH_ROUTER_TAIL", "")]
    kids, kw = ids, w
    if tail:
        key = (x.device, N, top_k, E)
        if key not in _FIXED_ROUTES:
            _FIXED_ROUTES[key] = ((torch.arange(N * top_k, device=x.device) * 5 % E).reshape(N, top_k),
                                  torch.full((N, top_k), 1.0 / top_k, device=x.device))
        ids, w = _FIXED_ROUTES[key]
        kids, kw = (torch.empty_like(ids), torch.empty_like(w)) if tail == 1 else (ids, w)
    # router_topk's launch config"""),
    ("router_weight, logits, counts, ids, w, xq, H, E, eps,",
     "router_weight, logits, counts, kids, kw, xq, H, E, eps,"),
    ("""EARLY="router" in cfg.early_weights and shape.BK >= block, POLL=poll,""",
     """EARLY="router" in cfg.early_weights and shape.BK >= block, POLL=poll and not tail, TAIL=tail,"""),
    ("""{"mail_ptr": shared_mailbox(x.device, cfg, E)} if poll else {}""",
     """{"mail_ptr": shared_mailbox(x.device, cfg, E)} if poll and not tail else {}"""),
]


def make_tree(src: Path, out: Path) -> None:
    pkg = src / "moebench"
    if not (pkg / "engine" / "kernels" / "norm_router.py").is_file():
        raise SystemExit(f"router_tail_tree: {pkg} has no engine/kernels/norm_router.py")
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(pkg, out / "moebench", ignore=shutil.ignore_patterns("__pycache__", "weights"))
    path = out / "moebench" / "engine" / "kernels" / "norm_router.py"
    text = path.read_text()
    for i, (old, new) in enumerate(EDITS):
        if text.count(old) != 1:
            raise SystemExit(f"router_tail_tree: edit {i} does not fit {path} (its anchor occurs "
                             f"{text.count(old)} times, expected once): the router changed; update EDITS")
        text = text.replace(old, new)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, default=Path("."), help="the tree to copy (holds moebench/)")
    ap.add_argument("--out", type=Path, required=True, help="where the copy goes (replaced)")
    args = ap.parse_args(argv)
    make_tree(args.src, args.out)
    print(f"router-tail tree in {args.out}; MOEBENCH_ROUTER_TAIL=full|reload|arrival|none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
