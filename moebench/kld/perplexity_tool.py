"""Drive llama.cpp's `llama-perplexity` for KLD, parse its statistics, read and write its base file.

Base file (tools/perplexity/perplexity.cpp, b11434): "_logits_", uint32 n_ctx, int32 n_vocab,
int32 n_chunk, int32 tokens[n_ctx * n_chunk] (the text's tokens, BOS NOT substituted), then per
chunk and per scored position (n_ctx - 1 - n_ctx/2 of them) one row of `row_width(n_vocab)` uint16
(see moebench.kld.stats.encode_logprobs). Rows are read lazily, one chunk at a time.
"""
from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moebench.json_fields import is_of
from moebench.json_types import JsonObject, JsonValue

from moebench.kld.stats import decode_logprobs, row_width
from moebench.store import open_append, open_fd, write_bytes_atomic

MAGIC = b"_logits_"


class PerplexityError(RuntimeError):
    """llama-perplexity failed, or its output or base file is not what was expected."""


# ---- base file -------------------------------------------------------------------------------------

@dataclass
class BaseFile:
    path: Path
    n_ctx: int
    n_vocab: int
    n_chunk: int
    tokens: np.ndarray           # [n_chunk, n_ctx] int32
    data_offset: int             # where the log-prob rows start

    @property
    def first(self) -> int:
        return self.n_ctx // 2

    @property
    def n_scored(self) -> int:
        """Scored positions per chunk: first ... n_ctx-2."""
        return self.n_ctx - 1 - self.n_ctx // 2

    @property
    def bytes_per_token(self) -> int:
        return 2 * row_width(self.n_vocab)

    def rows(self, chunk: int) -> np.ndarray:
        """The raw uint16 rows of one chunk: [n_scored, row_width]."""
        if not 0 <= chunk < self.n_chunk:
            raise PerplexityError(f"{self.path}: chunk {chunk} out of range (file holds {self.n_chunk})")
        w = row_width(self.n_vocab)
        count = self.n_scored * w
        with self.path.open("rb") as f:
            f.seek(self.data_offset + chunk * count * 2)
            data = np.fromfile(f, dtype="<u2", count=count)
        if data.size != count:
            raise PerplexityError(f"{self.path}: truncated in chunk {chunk} "
                                  f"({data.size} of {count} values); was llama-perplexity interrupted?")
        return data.reshape(self.n_scored, w)

    def logprobs(self, chunk: int) -> np.ndarray:
        """[n_scored, n_vocab] float32 base log-probs of one chunk."""
        return decode_logprobs(self.rows(chunk), self.n_vocab)


def read_base_file(path: str | Path) -> BaseFile:
    path = Path(path)
    with path.open("rb") as f:
        magic = f.read(8)
        if magic != MAGIC:
            raise PerplexityError(f"{path}: not a llama-perplexity base file (starts with {magic!r}, expected {MAGIC!r})")
        head = np.fromfile(f, dtype="<i4", count=3)
        if head.size != 3:
            raise PerplexityError(f"{path}: truncated header")
        n_ctx, n_vocab, n_chunk = (int(x) for x in head)
        if n_ctx <= 2 or n_vocab <= 0 or n_chunk <= 0:
            raise PerplexityError(f"{path}: bad header n_ctx={n_ctx} n_vocab={n_vocab} n_chunk={n_chunk}")
        tokens = np.fromfile(f, dtype="<i4", count=n_ctx * n_chunk)
        if tokens.size != n_ctx * n_chunk:
            raise PerplexityError(f"{path}: truncated token block")
    offset = 8 + 12 + 4 * n_ctx * n_chunk
    bf = BaseFile(path, n_ctx, n_vocab, n_chunk, tokens.reshape(n_chunk, n_ctx).astype(np.int64), offset)
    expected = offset + n_chunk * bf.n_scored * bf.bytes_per_token
    size = path.stat().st_size
    if size != expected:
        raise PerplexityError(f"{path}: {size} bytes, expected {expected} for n_ctx={n_ctx}, n_vocab={n_vocab}, "
                              f"n_chunk={n_chunk}")
    return bf


class BaseFileWriter:
    """Write a llama-perplexity base file chunk by chunk (from an engine baseline)."""

    def __init__(self, path: str | Path, n_ctx: int, n_vocab: int, tokens: np.ndarray):
        tokens = np.asarray(tokens, dtype="<i4")
        if tokens.ndim != 2 or tokens.shape[1] != n_ctx:
            raise ValueError(f"tokens must be [n_chunk, {n_ctx}], got {tokens.shape}")
        self.path, self.n_ctx, self.n_vocab = Path(path), n_ctx, n_vocab
        self.n_chunk = tokens.shape[0]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Run files are never written through a link planted in the run (moebench.store).
        with os.fdopen(open_fd(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), "wb") as f:
            f.write(MAGIC)
            np.array([n_ctx, n_vocab, self.n_chunk], dtype="<i4").tofile(f)
            tokens.tofile(f)

    def append_chunk(self, rows: np.ndarray) -> None:
        n_scored = self.n_ctx - 1 - self.n_ctx // 2
        if rows.shape != (n_scored, row_width(self.n_vocab)) or rows.dtype != np.uint16:
            raise ValueError(f"chunk rows must be uint16 [{n_scored}, {row_width(self.n_vocab)}], got "
                             f"{rows.dtype} {rows.shape}")
        with open_append(self.path) as f:
            rows.astype("<u2").tofile(f)


# ---- running llama-perplexity -----------------------------------------------------------------------

def _binary() -> str:
    from moebench.tools.llamacpp import tool
    return str(tool("llama-perplexity", build=True))


def run_perplexity(model: str | Path, args: list[str], log_path: Path | None = None,
                   timeout_s: float | None = None, binary: str | None = None,
                   commands: list[list[str]] | None = None) -> str:
    """Run llama-perplexity; return its stdout (the statistics). stderr (progress) goes to log_path.
    The exact command line is appended to `commands` when given (it goes into the run's manifest)."""
    cmd = [binary or _binary(), "-m", str(model), *args]
    if commands is not None:
        commands.append(cmd)
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s)
    if log_path is not None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(log_path, f"$ {' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"
                           .encode("utf-8"))
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise PerplexityError(f"llama-perplexity exited {proc.returncode}: {' '.join(cmd)}\n{tail}")
    errs = [ln for ln in proc.stderr.splitlines() if re.search(r"(kl_divergence|perplexity): .*(failed|must|need|inconsistent)", ln)]
    if errs:
        raise PerplexityError(f"llama-perplexity reported: {errs[0].strip()}")
    return proc.stdout


def _common_args(context: int, threads: int | None, extra: list[str] | None) -> list[str]:
    """-c and a batch as large as the context (one chunk per batch) unless the extra (the candidate's
    own flags) set the batch; -t from the suite unless the extra set the threads."""
    extra = list(extra or [])
    names = {a.split("=", 1)[0] for a in extra}
    args = ["-c", str(context)]
    if not names & {"-b", "--batch-size"}:
        args += ["-b", str(context)]
    if threads and not names & {"-t", "--threads"}:
        args += ["-t", str(threads)]
    return args + extra


def write_base(model: str | Path, text_file: Path, base_path: Path, context: int, chunks: int | None,
               threads: int | None = None, log_path: Path | None = None, extra: list[str] | None = None,
               binary: str | None = None, commands: list[list[str]] | None = None) -> BaseFile:
    """`--kl-divergence-base`: the model's log-probs over the text's chunks into base_path."""
    args = ["-f", str(text_file), "--kl-divergence-base", str(base_path)]
    if chunks:
        args += ["--chunks", str(chunks)]
    run_perplexity(model, args + _common_args(context, threads, extra), log_path, binary=binary,
                   commands=commands)
    return read_base_file(base_path)


def kl_divergence(model: str | Path, base_path: Path, context: int, threads: int | None = None,
                  log_path: Path | None = None, extra: list[str] | None = None, binary: str | None = None,
                  commands: list[list[str]] | None = None) -> PrintedKld:
    """`--kl-divergence` against a base file; returns the parsed statistics (parse_kld_output)."""
    args = ["--kl-divergence-base", str(base_path), "--kl-divergence"]
    out = run_perplexity(model, args + _common_args(context, threads, extra), log_path, binary=binary,
                         commands=commands)
    return parse_kld_output(out)


# ---- parsing its statistics ------------------------------------------------------------------------

_NUM = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|[-+]?nan|[-+]?inf)"
_PM = _NUM + r"\s*±\s*" + _NUM
_LINES = {
    "ppl": r"^Mean PPL\(Q\)\s*:\s*" + _PM,
    "ppl_base": r"^Mean PPL\(base\)\s*:\s*" + _PM,
    "cor_ln_ppl_pct": r"^Cor\(ln\(PPL\(Q\)\), ln\(PPL\(base\)\)\):\s*" + _NUM + "%",
    "ln_ppl_ratio": r"^Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*" + _PM,
    "ppl_ratio": r"^Mean PPL\(Q\)/PPL\(base\)\s*:\s*" + _PM,
    "ppl_diff": r"^Mean PPL\(Q\)-PPL\(base\)\s*:\s*" + _PM,
    "mean": r"^Mean\s+KLD:\s*" + _PM,
    "dp_mean_pct": r"^Mean\s+Δp:\s*" + _PM + r"\s*%",
    "dp_rms_pct": r"^RMS Δp\s*:\s*" + _PM + r"\s*%",
    "same_top_pct": r"^Same top p:\s*" + _PM + r"\s*%",
}
_LADDER_NAMES = {"Maximum": "max", "99.9%": "p999", "99.0%": "p99", "95.0%": "p95", "90.0%": "p90",
                 "75.0%": "p75", "Median": "median", "25.0%": "p25", "10.0%": "p10", "5.0%": "p5",
                 "1.0%": "p1", "0.1%": "p01", "Minimum": "min"}
_CHUNK_LINE = re.compile(r"^\s*(\d+)\s+" + r"\s+".join([_PM] * 3) + r"\s+" + _PM + r"\s*%\s+" + _PM + r"\s*%\s*$")


# The figures llama-perplexity (b11434) prints, in the order it prints them: each a pair (value, its
# uncertainty `<name>_err`) but the correlation; then the KLD ladder; then same top p.
_FIGURES = ("ppl", "ppl_base", "cor_ln_ppl", "ln_ppl_ratio", "ppl_ratio", "ppl_diff", "mean")
_PAIRED = {"ppl", "ppl_base", "ln_ppl_ratio", "ppl_ratio", "ppl_diff", "mean", "same_top_p"}
# llama prints p75/p25 for Δp only; the KLD order holds them too, so a build that prints them keeps them.
_LADDER_ORDER = ("max", "p999", "p99", "p95", "p90", "p75", "median", "p25", "p10", "p5", "p1", "p01", "min")


@dataclass(frozen=True)
class ChunkLine:
    """One chunk line of llama-perplexity's output: the running figures after that chunk."""

    chunk: int
    ppl: float
    ln_ppl_ratio: float
    kld: float
    dp_rms: float
    same_top_p: float

    def to_json(self) -> JsonObject:
        return {"chunk": self.chunk, "ppl": self.ppl, "ln_ppl_ratio": self.ln_ppl_ratio, "kld": self.kld,
                "dp_rms": self.dp_rms, "same_top_p": self.same_top_p}


@dataclass(frozen=True)
class PrintedKld:
    """What `--kl-divergence` printed, in stats.summarize's keys (fractions, not %): `figures` by name
    (each printed value and its `_err`, the correlation, the KLD ladder, same top p), the Δp figures,
    each chunk's running line and each chunk's own mean KLD recovered from them. Below 100 scored
    tokens llama prints only the chunk lines."""

    figures: dict[str, float]
    delta_p: dict[str, float]
    per_chunk_cumulative: list[ChunkLine]
    per_chunk: list[float]

    def to_json(self) -> JsonObject:
        """llama_stats.json: the figures in the order llama prints them."""
        out: JsonObject = {k: self.figures[k] for k in _figure_order() if k in self.figures}
        if self.delta_p:
            out["delta_p"] = {k: self.delta_p[k] for k in _dp_order() if k in self.delta_p}
        if self.per_chunk_cumulative:
            out["per_chunk_cumulative"] = [c.to_json() for c in self.per_chunk_cumulative]
            out["per_chunk"] = list(self.per_chunk)
        return out

    @staticmethod
    def from_json(doc: JsonValue, where: str) -> PrintedKld:
        """llama_stats.json read back; a key that is not a number (a list for the chunk lines) is
        refused naming the file and the key."""
        if not isinstance(doc, dict):
            raise PerplexityError(f"{where}: not a JSON object")
        figures = {k: _number(doc, k, where) for k in _figure_order() if k in doc}
        dp = doc.get("delta_p", {})
        if not isinstance(dp, dict):
            raise PerplexityError(f"{where}: key 'delta_p' must be an object")
        lines = doc.get("per_chunk_cumulative", [])
        per = doc.get("per_chunk", [])
        if not isinstance(lines, list) or not all(isinstance(x, dict) for x in lines):
            raise PerplexityError(f"{where}: key 'per_chunk_cumulative' must be a list of objects")
        if not isinstance(per, list):
            raise PerplexityError(f"{where}: key 'per_chunk' must be a list of numbers")
        try:
            chunks = [ChunkLine(chunk=int(x["chunk"]), ppl=float(x["ppl"]), ln_ppl_ratio=float(x["ln_ppl_ratio"]),
                                kld=float(x["kld"]), dp_rms=float(x["dp_rms"]), same_top_p=float(x["same_top_p"]))
                      for x in lines]
        except (KeyError, TypeError, ValueError) as e:
            raise PerplexityError(f"{where}: a 'per_chunk_cumulative' line lacks or mistypes {e}") from None
        return PrintedKld(figures=figures, delta_p={k: _number(dp, k, f"{where} delta_p") for k in _dp_order() if k in dp},
                          per_chunk_cumulative=chunks,
                          per_chunk=[_number({"per_chunk": v}, "per_chunk", where) for v in per])


def _figure_order() -> list[str]:
    names: list[str] = []
    for f in _FIGURES:
        names += [f, f + "_err"] if f in _PAIRED else [f]
    return names + list(_LADDER_ORDER) + ["same_top_p", "same_top_p_err"]


def _dp_order() -> list[str]:
    return ["mean", "mean_err", *_LADDER_ORDER, "rms", "rms_err"]


def _number(doc: JsonObject, key: str, where: str) -> float:
    v = doc[key]
    if not is_of(v, (float,)):
        raise PerplexityError(f"{where}: key {key!r} must be a number, got {v!r}")
    return float(v)


def parse_kld_output(stdout: str) -> PrintedKld:
    """llama-perplexity --kl-divergence stdout -> the same keys as stats.summarize (fractions, not %).

    Also `per_chunk_cumulative`: each chunk line's running figures (llama prints cumulative means), and
    `per_chunk`: each chunk's own mean KLD, recovered from the running means (chunks are equal-sized).
    """
    out: dict[str, float] = {}
    dp: dict[str, float] = {}
    lines = [ln.strip() for ln in stdout.splitlines()]
    for ln in lines:
        for key, pat in _LINES.items():
            m = re.match(pat, ln)
            if not m:
                continue
            vals = [float(x) for x in m.groups()]
            if key == "cor_ln_ppl_pct":
                out["cor_ln_ppl"] = vals[0] / 100
            elif key == "dp_mean_pct":
                dp["mean"], dp["mean_err"] = vals[0] / 100, vals[1] / 100
            elif key == "dp_rms_pct":
                dp["rms"], dp["rms_err"] = vals[0] / 100, vals[1] / 100
            elif key == "same_top_pct":
                out["same_top_p"], out["same_top_p_err"] = vals[0] / 100, vals[1] / 100
            else:
                out[key], out[key + "_err"] = vals[0], vals[1]
        m = re.match(r"^(Maximum|Median|Minimum|\d+\.\d%)\s+(KLD|Δp):\s*" + _NUM + r"\s*%?$", ln)
        if m:
            name = _LADDER_NAMES.get(m.group(1))
            if name:
                v = float(m.group(3))
                if m.group(2) == "KLD":
                    out[name] = v
                else:
                    dp[name] = v / 100
    cumulative = []
    for ln in lines:
        m = _CHUNK_LINE.match(ln)
        if m:
            g = [float(x) for x in m.groups()]
            cumulative.append(ChunkLine(chunk=int(g[0]), ppl=g[1], ln_ppl_ratio=g[3], kld=g[5], dp_rms=g[7] / 100,
                                        same_top_p=g[9] / 100))
    # each chunk's own mean from the running means (chunks are equal-sized)
    per = [c.kld * (i + 1) - (cumulative[i - 1].kld * i if i else 0.0) for i, c in enumerate(cumulative)]
    if "mean" not in out and not cumulative:
        raise PerplexityError("no KLD statistics in llama-perplexity's output (fewer than 100 tokens scored, "
                              "or not a --kl-divergence run)")
    return PrintedKld(figures=out, delta_p=dp, per_chunk_cumulative=cumulative, per_chunk=per)
