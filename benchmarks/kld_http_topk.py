"""How far the HTTP top-K KLD estimates sit from the exact KLD, measured through `moebench serve`.

Zoo model, engine float32 baseline (every chunk kept in full), the demo's tiered candidate measured
(1) by the engine runner (exact), (2) through `moebench serve` over the engine with the legacy echo
form at K = 5, 20, 100 and K = the whole vocabulary (exact over HTTP). Writes
benchmarks/results/kld_http_topk.json and prints a table.

    python benchmarks/kld_http_topk.py [--context 128] [--chunks 4] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

from moebench import api  # noqa: E402

VOCAB = 50257


def run(suite: Path, runner: Path, out: Path, baseline: Path | None = None) -> Path:
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(out),
                                           baseline=str(baseline) if baseline else None,
                                           as_baseline=baseline is None, quiet=True))
    if code != 0:
        raise SystemExit(f"{runner}: exit {code}")
    return run_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--ks", default=f"5,20,100,{VOCAB}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--hf", default=str(REPO / "models" / "zoo" / "tiny-moe"), help="the zoo's HF folder")
    args = ap.parse_args()
    from moebench.demo import pack_tiered
    from moebench.runners.engine import EngineRunner
    from moebench.serve import BackgroundServer, ServeOptions

    tmp = Path(args.out or tempfile.mkdtemp(prefix="kld-http-"))
    tmp.mkdir(parents=True, exist_ok=True)
    hf = Path(args.hf)
    tiered = pack_tiered(hf, tmp / "tiered", log=lambda *a: None)
    suite = tmp / "kld.toml"
    suite.write_text(f'name = "kld-http-topk"\n[[tasks]]\ntask = "kld"\ncontext = {args.context}\n'
                     f'chunks = {args.chunks}\ntop_k = 256\nfull_chunks = {args.chunks}\n[probes]\nnvml = false\n')
    profiles = {}
    for name, model in (("base", hf), ("cand", tiered)):
        p = tmp / f"engine-{name}.toml"
        p.write_text(f'kind = "engine"\nmodel = "{model}"\ndtype = "float32"\ndevice = "cpu"\n')
        profiles[name] = p
    base = run(suite, profiles["base"], tmp / "base")
    exact_run = run(suite, profiles["cand"], tmp / "engine-exact", base)
    _, cmp = api.compare(str(base), str(exact_run), out=str(tmp / "cmp-exact"), write_report=False)
    exact = cmp["kld"]
    rows = [{"k": "engine (full logits)", "method": exact["method"], "mean": exact["mean"],
             "same_top_p": exact["same_top_p"], "rel_err": 0.0, "wall_s": None}]
    ks = [int(k) for k in args.ks.split(",")]
    runner = EngineRunner({"model": str(tiered), "dtype": "float32", "device": "cpu"})
    with BackgroundServer(runner, ServeOptions(port=0, max_logprobs=max(ks))) as srv:
        for k in ks:
            prof = tmp / f"serve-echo-{k}.toml"
            prof.write_text(f'kind = "http"\nbase_url = "{srv.url}"\nmodel = "zoo"\ntoken_prompts = true\n'
                            f'prompt_logprobs = "echo"\nprompt_logprobs_k = {k}\ntokenizer = "{hf}"\n'
                            'timeout_s = 1800\nmax_response_bytes = 4000000000\n')
            t0 = time.time()
            cand = run(suite, prof, tmp / f"serve-echo-{k}", base)
            wall = time.time() - t0
            _, c = api.compare(str(base), str(cand), out=str(tmp / f"cmp-{k}"), write_report=False)
            kk = c["kld"]
            rows.append({"k": k, "method": kk["method"], "mean": kk["mean"], "same_top_p": kk["same_top_p"],
                         "rel_err": (kk["mean"] - exact["mean"]) / exact["mean"], "wall_s": round(wall, 1)})
            print(f"K={k}: {kk['method']} mean {kk['mean']:.6f} ({rows[-1]['rel_err']:+.2%}), same top "
                  f"{kk['same_top_p']:.4f}, {wall:.0f} s", flush=True)
    result = {"context": args.context, "chunks": args.chunks, "n_tokens": exact["n_tokens"],
              "baseline": "engine float32, zoo tiny-moe (all chunks in full)",
              "candidate": "demo tiered pack of the zoo model, served by `moebench serve` (echo)",
              "rows": rows, "measured": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    out = REPO / "benchmarks" / "results" / "kld_http_topk.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
