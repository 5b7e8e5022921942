"""Which of a llama-server profile's `args` go to llama-perplexity when KLD measures that candidate.

KLD must measure the model as the candidate serves it: the same build, the same placement (GPU layers,
tensor split, expert offload) and the same numerics (KV-cache types, flash attention, batch sizes,
threads, RoPE overrides). llama.cpp defines those flags once, in its common arguments
(`common/arg.cpp`, options without an example restriction), and both llama-server and
llama-perplexity accept them. So each flag of the profile's `args` is sorted into one of three bins:

- passed: llama-perplexity's own `--help` lists it (the candidate binary's, so a patched build's
  extra flags pass too) and it is not in the dropped bin. Placement and numerics flags of b11434 are
  all here: -ngl, -ts, -sm, -mg, -dev, --n-cpu-moe, --cpu-moe, --n-cpu-ffn, -ot/--override-tensor,
  -fit*, --no-host, --repack, --op-offload, -ctk, -ctv, -kvo/-nkvo, -fa, --swa-full, -kvu, -t, -tb,
  -C/-Cr/--cpu-strict/--prio/--poll (and their -batch forms), --numa, -b, -ub, --rope-*, --yarn-*,
  --override-kv, --control-vector*, -lm/--load-mode (older builds: --mlock, --no-mmap), --rpc,
  --check-tensors, logging flags;
- dropped: flags that cannot change teacher-forced log-probs, and the context: server networking,
  API, UI and slots (--host, --port, -np, --metrics, --api-key, -a, --jinja, --cache-reuse, ...),
  sampling and generation (--temp, --top-k, -n, --seed, --grammar, ...), speculative decoding (the
  draft model never changes the target's logits), multimodal projectors, and -c/--ctx-size (the
  suite's `context` sets llama-perplexity's -c); they are listed in the record as dropped;
- refused: everything else, i.e. a flag that llama-perplexity does not know and that is not known
  to be irrelevant. KLD then stops before any work with an error naming the flags: measuring without
  them would measure a different candidate.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from moebench.json_types import JsonObject
from moebench.tools.binary_probe import PROBE, ProbeError

# Exact names of flags that do not change the log-probs of a teacher-forced pass (llama.cpp b11434,
# common/arg.cpp: the server-only options plus the common sampling/prompt/multimodal ones).
DROPPED_NAMES = frozenset("""
-c --ctx-size -np --parallel --host --port --reuse-port --path --metrics --props --slots --no-slots
--threads-http -to --timeout --sse-ping-interval -a --alias --tags --api-key --api-key-file
--jinja --no-jinja --special -sp --pooling --embedding --embeddings --rerank --reranking
-cb --cont-batching -nocb --no-cont-batching --cache-prompt --no-cache-prompt --cache-reuse
-cram --cache-ram -ctxcp --ctx-checkpoints --swa-checkpoints -cms --checkpoint-min-step
--cache-idle-slots --no-cache-idle-slots -sps --slot-prompt-similarity --slot-save-path
-lcs --lookup-cache-static -lcd --lookup-cache-dynamic --kv-unified-per-slot
-r --reverse-prompt --spm-infill --embd-normalize --lora-init-without-apply --sleep-idle-seconds
--log-prompts-dir --media-path --skip-chat-parsing --no-skip-chat-parsing --prefill-assistant
--no-prefill-assistant -rea --agent --no-agent -ag -no-ag --tools --tools-runtime
-n --predict --n-predict --keep -p --prompt -f --file -bf --binary-file -e --escape --no-escape
-s --seed --samplers --sampler-seq --sampling-seq --ignore-eos --temp --temperature --top-k --top-p
--min-p --top-nsigma --top-n-sigma --xtc-probability --xtc-threshold --typical --typical-p
--repeat-last-n --repeat-penalty --presence-penalty --frequency-penalty --dry-multiplier --dry-base
--dry-allowed-length --dry-penalty-last-n --dry-sequence-breaker --adaptive-target --adaptive-decay
--dynatemp-range --dynatemp-exp --mirostat --mirostat-lr --mirostat-ent -l --logit-bias --grammar
--grammar-file -j --json-schema -jf --json-schema-file -bs --backend-sampling
-mm --mmproj -mmu --mmproj-url --mmproj-offload --no-mmproj-offload --no-mmproj --mmproj-auto
--no-mmproj-auto --mtmd-batch-max-tokens --image-min-tokens --image-max-tokens --video-fps
--video-timestamp-interval --video-ffmpeg-dir --draft --draft-n --draft-max --draft-min --draft-n-min
--draft-p-min --draft-p-split -md --model-draft -hfd -hfrd --hf-repo-draft -devd --device-draft
-ngld --gpu-layers-draft --n-gpu-layers-draft -td --threads-draft -tbd --threads-batch-draft
-Cd -Crd -Cbd -otd -cmoed -ncmoed -ctkd -ctvd
""".split())
# Families of the same kind, by pattern (speculative decoding, UI, CORS/TLS/API, chat templates, ...).
DROPPED_PATTERNS = tuple(re.compile(p) for p in (
    r"^--spec-", r"-draft$", r"^--(no-)?(web)?ui(-|$)", r"^--cors-", r"^--ssl-", r"^--api-",
    r"^--(no-)?reasoning", r"^--chat-template", r"^--(no-)?models-", r"^--mcp-", r"^--fim-",
    r"-default$", r"^--spec$",
))
# Set by the KLD task itself; the profile's values would contradict the measurement.
OWNED_NAMES = frozenset({"-m", "--model", "--chunks", "--kl-divergence", "--kl-divergence-base"})


class ArgsError(ValueError):
    """The profile's args cannot be given to llama-perplexity; the message names the flags."""


@dataclass
class HelpFlags:
    """What a llama.cpp binary's --help says: every flag name and whether it takes a value."""

    takes_value: dict[str, bool] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.takes_value


# flags separated by commas, then an optional value placeholder (which may hold single spaces, e.g.
# "<tensor name pattern>=<buffer type>,..."), then two or more spaces before the description
_HELP_LINE = re.compile(r"^\s*(-[^\s,][^\s,]*(?:,\s*-[^\s,]+)*)(?:\s([^\s-].*?))?(?:\s{2,}|\s*$)")


def parse_help(text: str) -> HelpFlags:
    """Flags of a llama.cpp `--help` text: lines like `-ngl, --gpu-layers, --n-gpu-layers N   ...`
    (a trailing word that does not start with '-' is the value placeholder)."""
    out = HelpFlags()
    for line in text.splitlines():
        m = _HELP_LINE.match(line)
        if not m:
            continue
        names = [n.strip() for n in m.group(1).split(",")]
        value = m.group(2) is not None
        for name in names:
            if re.fullmatch(r"--?[A-Za-z0-9][\w.+-]*", name):
                # A negative form (--no-x, -nkvo) sits in one line with the positive one but takes no value.
                out.takes_value.setdefault(name, value and not name.startswith(("--no-", "-no")))
    return out


def help_flags(binary: str | Path) -> HelpFlags:
    """The flags `binary --help` lists (binary_probe.PROBE runs it once per binary file)."""
    try:
        return parse_help(PROBE.help_text(binary))
    except ProbeError as e:
        raise ArgsError(str(e)) from None


def version_line(binary: str | Path) -> str:
    """The first `version: ...` line of `binary --version` (llama.cpp prints it on stderr)."""
    try:
        proc = PROBE.version(binary)
    except ProbeError as e:
        return f"unknown ({e})"
    lines = [ln.strip() for ln in proc.text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("version:"):
            return ln
    return lines[0] if lines else f"unknown (exit {proc.returncode}, no output)"


def is_dropped(name: str) -> bool:
    return name in DROPPED_NAMES or any(p.search(name) for p in DROPPED_PATTERNS)


@dataclass
class SortedArgs:
    passed: list[str]             # argv fragment for llama-perplexity, in the profile's order
    dropped: list[str]            # flags (with values) left out, and why they may be
    refused: list[str]            # flag names llama-perplexity does not know

    def as_record(self) -> dict[str, list[str]]:
        return {"passed": self.passed, "dropped": self.dropped}


def sort_args(args: list[str], perplexity: HelpFlags, server: HelpFlags | None = None) -> SortedArgs:
    """Split a llama-server args list into what llama-perplexity gets, what is dropped, what is refused.

    Whether a flag takes a value comes from llama-perplexity's help, else llama-server's; a flag
    neither knows takes the next word as its value unless that word starts with '-'."""
    passed: list[str] = []
    dropped: list[str] = []
    refused: list[str] = []
    i = 0
    while i < len(args):
        word = args[i]
        if not word.startswith("-") or word in ("-", "--"):
            refused.append(word)              # a stray value: the args list is not what we think it is
            i += 1
            continue
        name, eq, inline = word.partition("=")
        if name in perplexity:
            takes = perplexity.takes_value[name]
        elif server is not None and name in server:
            takes = server.takes_value[name]
        else:
            takes = i + 1 < len(args) and not args[i + 1].startswith("-")
        group = [word]
        if takes and not eq:
            if i + 1 < len(args):
                group.append(args[i + 1])
            i += 1
        i += 1
        if name in OWNED_NAMES:
            refused.append(name)
        elif is_dropped(name):
            dropped.extend(group)
        elif name in perplexity:
            passed.extend(group)
        else:
            refused.append(name)
    return SortedArgs(passed, dropped, refused)


def perplexity_args(args: list[str], perplexity_binary: str | Path, where: str) -> SortedArgs:
    """sort_args on llama-perplexity's own help; raise ArgsError naming refused flags. (The server
    binary is not asked: KLD starts no llama-server process at all, not even for --help.)"""
    ppl = help_flags(perplexity_binary)
    if not ppl.takes_value:
        raise ArgsError(f"{perplexity_binary} --help lists no flags: is it llama.cpp's llama-perplexity?")
    out = sort_args(list(args), ppl)
    if out.refused:
        owned = [f for f in out.refused if f in OWNED_NAMES]
        unknown = [f for f in out.refused if f not in OWNED_NAMES]
        parts = []
        if unknown:
            parts.append(f"{', '.join(unknown)} {'is' if len(unknown) == 1 else 'are'} not known to "
                         f"{perplexity_binary} (its --help does not list "
                         f"{'it' if len(unknown) == 1 else 'them'}) and not a known server-only or sampling "
                         "flag, so KLD would measure the model without "
                         f"{'it' if len(unknown) == 1 else 'them'}")
        if owned:
            parts.append(f"{', '.join(owned)} {'is' if len(owned) == 1 else 'are'} set by the KLD task itself")
        raise ArgsError(f"{where}: key 'args': " + "; ".join(parts)
                        + " (docs/kld.md lists which flags pass to llama-perplexity)")
    return out


@dataclass
class PerplexityPlan:
    """How KLD runs llama-perplexity for one llama-server candidate: its build, its model, its flags."""

    binary: str                   # the llama-perplexity that runs
    version: str                  # its `--version` line
    source: str                   # why this binary: beside the profile's `binary`, or the built tools
    model: str                    # the profile's GGUF
    args: list[str]               # the profile's placement/numerics flags passed through
    dropped: list[str]            # the profile's flags left out (server-only, sampling, context)
    server_binary: str | None = None

    def as_record(self) -> JsonObject:
        """The plan as the KLD task writes it into llama_perplexity.json."""
        return {"binary": self.binary, "version": self.version, "source": self.source, "model": self.model,
                "args": list(self.args), "dropped_args": list(self.dropped), "server_binary": self.server_binary}
