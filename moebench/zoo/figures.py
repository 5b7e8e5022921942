"""Measure how informative the zoo model is, with llama.cpp's own tools.

- WikiText-2 test perplexity of the BF16 GGUF (`llama-perplexity -c 512 --chunks 8`, CRLF -> LF);
- mean KLD and same-top-p of Q8_0 and Q4_0 against BF16 (`--kl-divergence-base` / `--kl-divergence`);
- expert load skew: share of routed token slots taken by the busiest 25% of experts on training text.

    python -m moebench.zoo.figures [--zoo models/zoo]     # prints JSON (docs/zoo.md quotes it)
"""
from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path
from typing import TypedDict

from moebench import jsonout
from moebench.zoo.train import LoadSkew

_FLOAT = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"
_PATTERNS = {
    "ppl": re.compile(r"Final estimate: PPL = " + _FLOAT + r" \+/- " + _FLOAT),
    "mean_kld": re.compile(r"Mean    KLD:\s*" + _FLOAT + r"\s*±\s*" + _FLOAT),
    "same_top_p_pct": re.compile(r"Same top p:\s*" + _FLOAT + r"\s*±\s*" + _FLOAT),
    "mean_ppl_q": re.compile(r"Mean PPL\(Q\)\s*:\s*" + _FLOAT + r"\s*±\s*" + _FLOAT),
    "mean_ln_ppl_ratio": re.compile(r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*" + _FLOAT + r"\s*±\s*" + _FLOAT),
    "max_kld": re.compile(r"Maximum KLD:\s*" + _FLOAT),
    "median_kld": re.compile(r"Median  KLD:\s*" + _FLOAT),
}


class FiguresError(RuntimeError):
    pass


def _perplexity(args: list[str]) -> str:
    from moebench.tools import llamacpp

    cmd = [str(llamacpp.tool("llama-perplexity")), "-t", "2", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise FiguresError(f"{' '.join(cmd)} failed (exit {proc.returncode}):\n" + "\n".join(out.splitlines()[-20:]))
    return out


def _grab(text: str, *keys: str) -> dict[str, float]:
    got = {}
    for key in keys:
        m = _PATTERNS[key].search(text)
        if m is None:
            raise FiguresError(f"llama-perplexity output has no {key!r} line; last lines:\n" + text[-1500:])
        got[key] = float(m.group(1))
        if m.lastindex and m.lastindex > 1:
            got[key + "_unc"] = float(m.group(2))
    return got


def expert_load_skew(hf_dir: Path, n_seqs: int = 16, seq_len: int = 512) -> LoadSkew:
    """Busiest-25%-of-experts share on the first n_seqs x seq_len tokens of the training text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moebench.datasets import data_dir, read_text
    from moebench.zoo.train import TRAIN_TEXT, load_skew, route_counts

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    ids = tok.encode(read_text(data_dir() / TRAIN_TEXT)[: n_seqs * seq_len * 8], add_special_tokens=False)
    if len(ids) < n_seqs * seq_len:
        raise FiguresError(f"{TRAIN_TEXT}: only {len(ids)} tokens, need {n_seqs * seq_len}")
    batch = torch.tensor(ids[: n_seqs * seq_len]).view(n_seqs, seq_len)
    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    return load_skew(route_counts(model, batch))


class ZooFigures(TypedDict):
    """The zoo model's figures: llama-perplexity's over wikitext2 for each GGUF (the quantized ones
    against bf16's logits) and the expert load on the training text."""

    ctx: int
    chunks: int
    corpus: str
    bf16: dict[str, float]      # ppl, ppl_unc
    q8_0: dict[str, float]      # mean_kld, same_top_p_pct, ... (each with _unc where the tool gives one)
    q4_0: dict[str, float]
    expert_load_training_text: LoadSkew


def measure_zoo(zoo_dir: Path, ctx: int = 512, chunks: int = 8, skew_seqs: int = 16) -> ZooFigures:
    from moebench.datasets import data_dir, data_file, read_text
    from moebench.zoo.build import GGUF_NAMES, HF_DIRNAME

    zoo_dir = Path(zoo_dir)
    for name in GGUF_NAMES.values():
        if not (zoo_dir / name).is_file():
            raise FiguresError(f"{zoo_dir / name} missing: run `moebench zoo build --out {zoo_dir}` first")
    wiki = data_file(data_dir(), "wikitext2/wiki.test.raw")
    grabbed: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(tmp) / "wiki.test.lf.txt"
        text.write_text(read_text(wiki), encoding="utf-8")
        base = Path(tmp) / "bf16.kld"
        out = _perplexity(["-m", str(zoo_dir / GGUF_NAMES["bf16"]), "-f", str(text), "-c", str(ctx),
                           "--chunks", str(chunks), "--kl-divergence-base", str(base)])
        grabbed["bf16"] = _grab(out, "ppl")
        for kind in ("q8_0", "q4_0"):
            out = _perplexity(["-m", str(zoo_dir / GGUF_NAMES[kind]), "--kl-divergence-base", str(base),
                               "--kl-divergence", "-c", str(ctx)])
            grabbed[kind] = _grab(out, "mean_kld", "same_top_p_pct", "mean_ppl_q", "mean_ln_ppl_ratio",
                                  "max_kld", "median_kld")
    return {"ctx": ctx, "chunks": chunks, "corpus": "wikitext2/wiki.test.raw (CRLF -> LF)",
            "bf16": grabbed["bf16"], "q8_0": grabbed["q8_0"], "q4_0": grabbed["q4_0"],
            "expert_load_training_text": expert_load_skew(zoo_dir / HF_DIRNAME, n_seqs=skew_seqs)}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Perplexity, KLD and expert-load figures of the zoo model.")
    ap.add_argument("--zoo", default="models/zoo")
    args = ap.parse_args(argv)
    print(jsonout.document_text(measure_zoo(Path(args.zoo)), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
