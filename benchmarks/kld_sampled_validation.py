"""Validation of the sampled KLD estimate (docs/kld.md, "Sampled KLD"): is its interval honest, how far
is it from the exact KLD, and how does it compare with the top-K = 20 lower bound on the same tokens.

Zoo model, engine BF16 weights (float32 compute on CPU, the engine-bf16 profile) as the baseline p, the
demo's tiered pack (models/zoo/tiny-moe-tiered) as the candidate q. Each seeded repeat samples, from
the baseline, `continuations` continuations of `tokens` tokens after each of `prompts` WikiText-2
prompts (temperature 1, no truncation, EOS ignored: what `method = "sampled"` asks servers for), then on
the very contexts that were sampled computes with the engine's full distributions:
- the exact per-position KL(p || q) over the whole vocabulary;
- the sampled estimates (low-variance and plain) from log p(x_t) and log q(x_t) alone, with the
  bootstrap interval over sequences (moebench.kld.sampled_stats, the code the KLD task uses);
- the top-20 lower bound (moebench.kld.stats): baseline top 20 + lumped rest, with the
  candidate's exact log-probs of those ids (`topk_kld`, the tightest top-20 figure), and with the
  candidate's own top 20 + the actual token only (`sparse_kld`, what a vLLM-style server returns).
Repeats are grouped into runs of 1, 2 and 4 thousand tokens (1, 2 and 4 repeats), so every figure is
over independent seeded replicates. Writes benchmarks/results/kld_sampled_validation.json.

    python benchmarks/kld_sampled_validation.py [--repeats 100] [--prompts 16] [--continuations 2] [--tokens 32]

Each repeat's sums are appended to <out>.partial-<start>.jsonl as it finishes; `--start/--stop` run a
range of repeats (several processes may share the repeats), `--merge` only reads the partial files and
writes the result. Repeat r is sampled with seed `seed + r` whichever process runs it.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from moebench.kld import sampled_stats as sk
from moebench.kld import stats as ks

REPO = Path(__file__).resolve().parent.parent

K = 20
FIELDS = ("exact", "low-variance", "plain", "top20", "top20_server")


def sequence_sums(base, cand, prompt: list[int], cont: list[int]) -> dict[str, float]:
    """Per-token sums over one sampled continuation, every method on the same positions."""
    import torch
    ids = prompt + cont
    rows = slice(len(prompt) - 1, len(ids) - 1)             # row t predicts ids[t + 1]
    lp = torch.log_softmax(base.logits(ids)[rows].double(), dim=-1).numpy()
    cand_logits = cand.logits(ids)[rows].double().numpy()
    lq = ks.log_softmax(cand_logits)
    nxt = np.asarray(cont, np.int64)
    at = np.arange(nxt.size)
    exact = (np.exp(lp) * (lp - lq)).sum(axis=1)             # whole vocabulary, no floor
    lp_x, lq_x = lp[at, nxt], lq[at, nxt]
    part = np.argpartition(-lp, K, axis=1)[:, :K]           # the top K, then sorted
    top_ids = np.take_along_axis(part, np.argsort(-np.take_along_axis(lp, part, axis=1), axis=1), axis=1)
    top_lp = np.take_along_axis(lp, top_ids, axis=1)
    tail = np.log(np.clip(1.0 - np.exp(top_lp).sum(axis=1), 1e-300, None))
    bound = ks.topk_kld(top_ids, top_lp, tail, cand_logits, nxt, lp_x).kld
    q_top = np.argpartition(-lq, K, axis=1)[:, :K]
    served = [{**{int(t): float(lq[i, t]) for t in q_top[i]}, int(nxt[i]): float(lq_x[i])} for i in range(nxt.size)]
    bound_server = ks.sparse_kld(top_ids, top_lp, tail, lp_x, served, lq_x).kld
    return {"count": float(nxt.size), "exact": float(exact.sum()),
            "low-variance": float(sk.per_token(lp_x, lq_x, "low-variance").sum()),
            "plain": float(sk.per_token(lp_x, lq_x, "plain").sum()),
            "top20": float(bound.sum()), "top20_server": float(bound_server.sum())}


def group_figures(seqs: list[dict[str, float]], reference: float, seed: int) -> dict[str, float]:
    counts = np.array([s["count"] for s in seqs])
    n = counts.sum()
    out = {"n_tokens": int(n), "exact": sum(s["exact"] for s in seqs) / n}
    for est in ("low-variance", "plain"):
        sums = np.array([s[est] for s in seqs])
        lo, hi = sk.bootstrap_interval(sums, counts, seed)
        out[est] = sums.sum() / n
        out[f"{est}_lo"], out[f"{est}_hi"] = lo, hi
        out[f"{est}_covers_exact"] = bool(lo <= out["exact"] <= hi)
        out[f"{est}_covers_reference"] = bool(lo <= reference <= hi)
    for b in ("top20", "top20_server"):
        out[b] = sum(s[b] for s in seqs) / n
    return out


def summarize(groups: list[dict[str, float]]) -> dict[str, float]:
    ex = np.array([g["exact"] for g in groups])
    row: dict[str, float] = {"replicates": len(groups), "n_tokens": groups[0]["n_tokens"],
                             "exact_mean_of_runs": float(ex.mean())}
    for est in ("low-variance", "plain"):
        v = np.array([g[est] for g in groups])
        rel = (v - ex) / ex
        row[f"{est}_covers_exact"] = int(sum(g[f"{est}_covers_exact"] for g in groups))
        row[f"{est}_covers_reference"] = int(sum(g[f"{est}_covers_reference"] for g in groups))
        row[f"{est}_mean_abs_rel_err"] = float(np.abs(rel).mean())
        row[f"{est}_rms_rel_err"] = float(np.sqrt((rel ** 2).mean()))
        row[f"{est}_mean_rel_err"] = float(rel.mean())
        width = np.array([(g[f"{est}_hi"] - g[f"{est}_lo"]) / 2 for g in groups])
        row[f"{est}_half_width_rel"] = float((width / ex).mean())
    for b in ("top20", "top20_server"):
        rel = (np.array([g[b] for g in groups]) - ex) / ex
        row[f"{b}_mean_rel_err"] = float(rel.mean())
        row[f"{b}_mean_abs_rel_err"] = float(np.abs(rel).mean())
    return row


def sample_repeats(args, partial: Path) -> None:
    """Sample repeats [start, stop) and append each one's per-sequence sums to `partial`."""
    import torch
    from moebench.engine import Engine
    torch.set_num_threads(1)                        # a shared CPU: one thread per process
    # max_batch: the continuations of a repeat decode as one batch (the default of 1 runs them in turn)
    base = Engine.load(REPO / "models" / "zoo" / "tiny-moe", device="cpu", dtype="float32", max_batch=64)
    cand = Engine.load(REPO / "models" / "zoo" / "tiny-moe-tiered", device="cpu", dtype="float32")
    text = REPO.parent / "shared" / "datasets"
    corpus = (text / "wikitext2" / "wiki.test.raw").read_text(encoding="utf-8").replace("\r\n", "\n")
    ids = base.tokenize(corpus[:200_000])
    stride = len(ids) // args.prompts                         # prompts spread over the corpus
    prompts = [ids[j * stride:j * stride + args.prompt_tokens] for j in range(args.prompts)]
    t0 = time.time()
    for r in range(args.start, args.stop if args.stop is not None else args.repeats):
        batch = [p for p in prompts for _ in range(args.continuations)]
        outs = base.generate(batch, args.tokens, temperature=1.0, seed=args.seed + r, ignore_eos=True)
        seqs = [sequence_sums(base, cand, p, list(o.token_ids)) for p, o in zip(batch, outs)]
        with open(partial, "a") as f:
            f.write(json.dumps({"repeat": r, "seqs": seqs}) + "\n")
        n = sum(s["count"] for s in seqs)
        print(f"repeat {r}: {int(n)} tokens, exact {sum(s['exact'] for s in seqs) / n:.5f}, sampled "
              f"{sum(s['low-variance'] for s in seqs) / n:.5f}, top20 {sum(s['top20'] for s in seqs) / n:.5f} "
              f"({time.time() - t0:.0f} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=100)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--continuations", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--groups", default="1,2,4", help="repeats pooled into one run, per level")
    ap.add_argument("--start", type=int, default=0, help="first repeat this process samples")
    ap.add_argument("--stop", type=int, default=None, help="repeat after the last one this process samples")
    ap.add_argument("--merge", action="store_true", help="only merge the partial files into the result")
    ap.add_argument("--note", default="", help="how the repeats were run (kept in the result)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kld_sampled_validation.json"))
    args = ap.parse_args()
    out = Path(args.out)
    t0 = time.time()
    if not args.merge:
        sample_repeats(args, out.with_name(f"{out.stem}.partial-{args.start}.jsonl"))
    done: dict[int, list[dict[str, float]]] = {}
    for part in sorted(out.parent.glob(f"{out.stem}.partial*.jsonl")):
        for line in part.read_text().splitlines():
            if line.strip():
                rec = json.loads(line)
                done[rec["repeat"]] = rec["seqs"]
    missing = [r for r in range(args.repeats) if r not in done]
    if missing:
        raise SystemExit(f"repeats not sampled yet: {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    per_repeat = [done[r] for r in range(args.repeats)]
    allseq = [s for rep in per_repeat for s in rep]
    reference = sum(s["exact"] for s in allseq) / sum(s["count"] for s in allseq)
    levels = {}
    for g in (int(x) for x in args.groups.split(",")):
        groups = [group_figures([s for rep in per_repeat[i:i + g] for s in rep], reference, args.seed + i)
                  for i in range(0, args.repeats - g + 1, g)]
        levels[str(g)] = {**summarize(groups), "runs": groups}
    vocab = 50257                                   # the zoo's GPT-2 vocabulary
    result = {
        "baseline": "engine, zoo tiny-moe BF16 weights, float32 compute on CPU (engine-bf16 profile)",
        "candidate": "engine, models/zoo/tiny-moe-tiered (the demo's tiered pack)",
        "sampling": "temperature 1, no truncation, EOS ignored, engine.generate seeded per repeat",
        "prompts": args.prompts, "prompt_tokens": args.prompt_tokens, "continuations": args.continuations,
        "tokens": args.tokens, "repeats": args.repeats, "seed": args.seed,
        "confidence": sk.CONFIDENCE, "bootstrap": sk.BOOTSTRAP,
        "reference_exact_mean": reference, "reference_n_tokens": int(sum(s["count"] for s in allseq)),
        "bytes_per_token": {"sampled": 8, "top20": K * 4 + 8, "full": 2 * ks.row_width(vocab)},
        "bytes_note": "stored per scored token: sampled = token id (int32) + log p (float32); top-K = K x "
                      "(uint16 id + float16 log-prob) + rest + next-token log-prob (float32 each); full = "
                      "llama.cpp base-file row (uint16 per vocabulary entry)",
        "levels": levels, "note": args.note,
        # the sampling arguments only: --start/--stop/--merge split the same repeats over processes
        "command": "python benchmarks/kld_sampled_validation.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
            if k in ("repeats", "prompts", "prompt_tokens", "continuations", "tokens", "seed", "groups")),
        "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out.write_text(json.dumps(result, indent=1) + "\n")
    for g, row in levels.items():
        print(json.dumps({k: v for k, v in row.items() if k != "runs"}))


if __name__ == "__main__":
    main()
