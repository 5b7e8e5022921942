"""GPU benchmark, one call: needle at 173,000 tokens, the speed grid, NVML memory and energy.

Run on the GPU machine from the repository root:
    OUT=/some/dir python benchmarks/needle_speed_gpu.py
It builds a random-weight mid-size Qwen3-MoE checkpoint (transformers `save_pretrained`) with a
byte-level BPE tokenizer trained on the haystack, loads it with the in-repo engine (EngineRunner),
and, with the NVML probe sampling throughout:
  1. runs one needle cell at 173,000 tokens (prefill time, torch and NVML peak memory; a random
     model will not find the code, which is fine: the point is that the engine reaches the length);
  2. runs the speed grid (TTFT, prefill tok/s, decode tok/s per prompt length);
  3. checks that energy from NVML's counter and from integrated power agree within 5%.
Writes $OUT/needle_speed_gpu.json (plus the probe's nvml_samples.parquet / nvml_phases.json) and
prints a short table last. `--small` runs the same path with a tiny model on the CPU (a smoke test).
Every stage is guarded: a failing stage is recorded with its error and the rest still runs.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


from moebench.datasets import data_dir  # noqa: E402
from moebench.probes.nvml import NvmlProbe  # noqa: E402
from moebench.tasks.base import TaskContext  # noqa: E402
from moebench.tasks.needle import HAYSTACK_FILE, NeedleTask  # noqa: E402
from moebench.speed.compare import summarize_speed  # noqa: E402
from moebench.speed.task import SpeedTask  # noqa: E402

ENERGY_AGREEMENT = 0.05


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny model, short prompts, CPU: a smoke test")
    ap.add_argument("--needle-tokens", type=int, default=173000)
    ap.add_argument("--needle-depth", type=float, default=0.5)
    ap.add_argument("--speed-lengths", default="128,512,2048,8192,16384")
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prefill-chunk", type=int, default=1024)
    ap.add_argument("--interval-ms", type=int, default=20)
    ap.add_argument("--idle-s", type=float, default=3.0)
    a = ap.parse_args()
    if a.small:
        a.device, a.needle_tokens, a.speed_lengths = "cpu", 4096, "128,512"
        a.output_tokens, a.repeats, a.layers, a.hidden, a.experts = 8, 2, 2, 64, 8
        a.top_k, a.expert_width, a.vocab, a.prefill_chunk, a.idle_s = 2, 64, 2000, 512, 0.5
    return a


def build_tokenizer(vocab: int, out_dir: Path) -> int:
    """Byte-level BPE trained on the haystack (the engine reads tokenizer.json); returns the EOS id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = (data_dir() / HAYSTACK_FILE).read_text(encoding="utf-8")
    trainer = trainers.BpeTrainer(vocab_size=vocab - 1, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 100_000] for i in range(0, len(text), 100_000)], trainer)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    return tok.token_to_id("<|endoftext|>")


def build_checkpoint(a: argparse.Namespace, path: Path) -> dict[str, Any]:
    """A random-weight Qwen3-MoE checkpoint in Hugging Face format, initialised on the device."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    eos = build_tokenizer(a.vocab, path)
    heads = max(1, a.hidden // 128) if not a.small else 4
    cfg = Qwen3MoeConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 8), head_dim=a.hidden // heads if a.small else 128,
        num_experts=a.experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_width,
        intermediate_size=a.expert_width * 4, norm_topk_prob=True, decoder_sparse_step=1,
        max_position_embeddings=max(a.needle_tokens + 4096, 32768), eos_token_id=eos, bos_token_id=None,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(a.device):
        model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(str(path), safe_serialization=True)
    del model
    if a.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"params": n_params, "layers": a.layers, "hidden": a.hidden, "experts": a.experts, "top_k": a.top_k,
            "expert_width": a.expert_width, "vocab": a.vocab, "heads": heads}


def torch_peak_bytes(device: str) -> int | None:
    import torch
    return int(torch.cuda.max_memory_allocated()) if device.startswith("cuda") and torch.cuda.is_available() else None


async def main_async(a: argparse.Namespace, out: Path, report: dict[str, Any], probe: NvmlProbe | None) -> None:
    import torch
    from moebench.runners.engine import EngineRunner
    ctx = TaskContext(data_dir=data_dir(), run_dir=out, probe=probe)
    ckpt = Path(os.environ.get("TMPDIR", "/tmp")) / "moebench_gpu_bench_model"
    stage = "checkpoint"
    try:
        if probe:
            probe.mark("load")
        t0 = time.perf_counter()
        report["model"] = build_checkpoint(a, ckpt)
        report["model"]["build_s"] = time.perf_counter() - t0
        stage = "load"
        max_seq = a.needle_tokens + 1024
        runner = EngineRunner({"model": str(ckpt), "dtype": "bfloat16", "device": a.device,
                               "max_seq_len": max_seq, "prefill_chunk": a.prefill_chunk})
        t0 = time.perf_counter()
        await runner.start()
        report["model"]["load_s"] = time.perf_counter() - t0
        if probe:
            probe.mark("idle")
    except Exception as e:
        report["errors"][stage] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
        return

    try:
        stage = "needle"
        if a.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        task = NeedleTask({"lengths": [a.needle_tokens], "depths": [a.needle_depth], "max_tokens": 8}, ctx)
        t0 = time.perf_counter()
        await task.prepare(runner)
        item = task.items()[0]
        prep_s = time.perf_counter() - t0
        rec = (await task.evaluate(item, runner)).to_dict()
        report["needle"] = {k: rec.get(k) for k in ("prompt_tokens", "length", "depth", "needle_token_position",
                                                     "needle_position_exact", "ttft_s", "prefill_tok_s", "correct",
                                                     "answer", "reference", "wall_s", "fit_iterations")}
        report["needle"]["prepare_s"] = prep_s
        report["needle"]["torch_peak_allocated_bytes"] = torch_peak_bytes(a.device)
        report["needle"]["item_id"] = item.item_id

        stage = "speed"
        lengths = [int(x) for x in a.speed_lengths.split(",")]
        speed = SpeedTask({"prompt_lengths": lengths, "output_tokens": a.output_tokens, "repeats": a.repeats,
                           "clients": a.clients, "warmup": 1}, ctx)
        await speed.prepare(runner)
        records = []
        for it in speed.items():
            try:
                fields = await speed.evaluate(it, runner)
                records.append({"task": "speed", "item_id": it.item_id, "status": "ok", **fields})
            except Exception as e:
                records.append({"task": "speed", "item_id": it.item_id, "status": "error",
                                "error": f"{type(e).__name__}: {e}"})
        report["speed"] = {"summary": summarize_speed(records),
                           "n_ok": sum(r["status"] == "ok" for r in records),
                           "errors": [r["error"] for r in records if r["status"] == "error"][:5]}
        report["torch_peak_allocated_bytes"] = torch_peak_bytes(a.device)
    except Exception as e:
        report["errors"][stage] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}"
    finally:
        await runner.close()
        if probe:
            probe.mark("idle")


def energy_check(summary: dict[str, Any]) -> dict[str, Any]:
    """Counter vs trapezoid integral: the whole run and every phase that lasted 2 s or more."""
    e = summary.get("energy") or {}
    rows = []
    whole = e.get("whole_run") or {}
    if whole.get("rel_diff_integral_vs_counter") is not None:
        rows.append({"window": "whole_run", "duration_s": whole["duration_s"], "counter_j": whole["counter_j"],
                     "integral_j": whole["integral_j"], "rel_diff": whole["rel_diff_integral_vs_counter"]})
    for name, ph in (e.get("phases") or {}).items():
        if ph.get("rel_diff_integral_vs_counter") is not None and ph["duration_s"] >= 2.0:
            rows.append({"window": name, "duration_s": ph["duration_s"], "counter_j": ph["counter_j"],
                         "integral_j": ph["integral_j"], "rel_diff": ph["rel_diff_integral_vs_counter"]})
    ok = bool(rows) and all(abs(r["rel_diff"]) <= ENERGY_AGREEMENT for r in rows)
    return {"rows": rows, "tolerance": ENERGY_AGREEMENT, "pass": ok if rows else None,
            "power_column": e.get("power_column")}


def print_table(report: dict[str, Any]) -> None:
    def gib(x):
        return f"{x / 2**30:.2f} GiB" if x else "-"
    print("\n=== needle_speed_gpu ===")
    m = report.get("model") or {}
    print(f"model: {m.get('params', 0) / 1e9:.2f} B params, {m.get('layers')} layers, {m.get('experts')} experts "
          f"top-{m.get('top_k')}; build {m.get('build_s', 0):.0f} s, load {m.get('load_s', 0):.1f} s")
    n = report.get("needle")
    if n:
        print(f"needle {n['item_id']}: prompt {n['prompt_tokens']} tokens, needle at token {n['needle_token_position']}, "
              f"TTFT {n.get('ttft_s') or 0:.2f} s, prefill {n.get('prefill_tok_s') or 0:,.0f} tok/s, "
              f"found={n['correct']}, torch peak {gib(n.get('torch_peak_allocated_bytes'))}")
    sp = (report.get("speed") or {}).get("summary") or {}
    if sp:
        print(f"{'prompt':>8} {'clients':>7} {'TTFT ms':>9} {'prefill tok/s':>14} {'decode tok/s':>13} {'n':>3}")
        for length, by_c in sp.items():
            for c, g in by_c.items():
                t, p, d = g["ttft_s"], g["prefill_tok_s"], g["decode_tok_s"]
                print(f"{length:>8} {c:>7} {t['median'] * 1000 if t else float('nan'):>9.1f} "
                      f"{p['median'] if p else float('nan'):>14,.0f} {d['median'] if d else float('nan'):>13.1f} "
                      f"{t['n'] if t else 0:>3}")
    mem = (report.get("nvml_summary") or {}).get("memory") or {}
    if mem.get("n_samples"):
        print(f"NVML: peak used {gib(mem.get('peak_used_bytes'))}, min free {gib(mem.get('min_free_bytes'))}, "
              f"reserved {gib(mem.get('reserved_bytes'))}, {mem['n_samples']} samples")
    en = (report.get("nvml_summary") or {}).get("energy") or {}
    if en:
        pt = en.get("per_token") or {}
        print(f"idle {en.get('idle_power_w') or 0:.0f} W; J/token net: prefill "
              f"{(pt.get('prefill') or {}).get('net_j_per_token')}, decode {(pt.get('decode') or {}).get('net_j_per_token')}")
    chk = report.get("energy_check") or {}
    for r in chk.get("rows", []):
        print(f"energy {r['window']:>14}: counter {r['counter_j']:.1f} J, integral {r['integral_j']:.1f} J, "
              f"diff {r['rel_diff'] * 100:+.2f}% over {r['duration_s']:.1f} s")
    print(f"energy agreement within {ENERGY_AGREEMENT:.0%}: {chk.get('pass')}  "
          f"(NVML: {report.get('nvml', {}).get('available')})")
    for stage, err in (report.get("errors") or {}).items():
        print(f"ERROR in {stage}: {err.splitlines()[0]}")


def main() -> int:
    a = parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"args": vars(a), "errors": {}}
    try:
        import torch
        report["torch"] = torch.__version__
        report["cuda"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as e:
        report["errors"]["torch"] = str(e)
    probe = NvmlProbe(interval_ms=a.interval_ms, idle_s=a.idle_s, tariffs={"day": 0.30, "night": 0.15,
                                                                        "currency": "EUR"})
    report["nvml"] = {"available": probe.available, "reason": probe.reason, **probe.device}
    if probe.available:
        probe.start(out)
    t0 = time.perf_counter()
    try:
        asyncio.run(main_async(a, out, report, probe if probe.available else None))
    finally:
        report["wall_s"] = time.perf_counter() - t0
        if probe.available:
            info = probe.stop()
            report["nvml"].update({k: v for k, v in info.items() if k != "summary"})
            report["nvml_summary"] = info["summary"]
            report["energy_check"] = energy_check(info["summary"])
        else:
            report["energy_check"] = {"pass": None, "rows": [], "reason": probe.reason}
        (out / "needle_speed_gpu.json").write_text(json.dumps(report, indent=2, default=str))
        print_table(report)
    return 0 if not report["errors"] and report["energy_check"].get("pass") is not False else 1


if __name__ == "__main__":
    sys.exit(main())
