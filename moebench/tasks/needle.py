"""Needle in a haystack: a secret code hidden at a chosen depth of a long prompt of a chosen length.

Grid: `lengths` (target prompt tokens) x `depths` (0 = first sentence, 1 = last). Each cell is one item
`needle/<target tokens>/<depth>` with its own 10-character code drawn from `seed`, written as one
sentence at a sentence boundary of the haystack (War and Peace from the data mirror). Prompt lengths
are counted with the runner's OWN tokenizer and land within 0.5% of the target; the real count is
recorded. The question never contains the code; scoring is an exact match of the code in the output.

Length fitting: `prepare(runner)` tokenizes the haystack once, in pieces, into a `HaystackIndex`
(cumulative token counts at piece boundaries). A cell's haystack cut is estimated from the index and
then corrected against the exact token count of the whole prompt (a few tokenize calls per cell).
"""
from __future__ import annotations

import bisect
import random
import re
import string
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable, TypedDict

from moebench.config import MAX_NEW_TOKENS, MAX_PROMPT_TOKENS, MAX_SEED, Field, positive
from moebench.datasets import data_file, register
from moebench.runners.base import Capability, GenerateRequest, Runner
from moebench.store.records import ItemRecord
from moebench.tasks.base import Item, Task, TaskContext, TaskOptions, prompt_hash, prompt_tokens_check, runner_fields
from moebench.tasks.records import AccuracySummary, scored

HAYSTACK_FILE = "haystack/war_and_peace.txt"
DEFAULT_LENGTHS = [4096, 16384, 65536, 131072, 173000]
DEFAULT_DEPTHS = [0.0, 0.1, 0.2, 0.3, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
LENGTH_TOLERANCE = 0.005          # a prompt lands within 0.5% of its target token count

# The prompt ends its preamble with "Passage:" and the needle always starts with " The": the text
# before the needle then ends on punctuation, a clean pre-token boundary for byte-level BPE and
# SentencePiece alike, so the tokens of the text before the needle are a prefix of the prompt's.
PROMPT_HEAD = ("Below is a long passage from a novel. Hidden somewhere in it is one sentence that states "
               "a secret access code. Read the passage, then answer the question that follows it.\n\n"
               "Passage:")
NEEDLE_TEMPLATE = " The secret access code is {code}."
QUESTION = ("\n\nQuestion: What is the secret access code stated in the passage above? "
            "Reply with the code only.\nAnswer:")
CODE_ALPHABET = "".join(c for c in string.ascii_uppercase + string.digits if c not in "O0I1")
CODE_LENGTH = 10

# End of a sentence: . ! ? with any closing quotes/brackets, followed by whitespace.
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*(?=\s)")


class NeedleError(ValueError):
    """A cell cannot be built (haystack too short, length not reachable); names the cell."""


def format_depth(depth: float) -> str:
    """Depth as it appears in item ids: 0, 0.1, 0.45, 1 (no float noise)."""
    return f"{round(float(depth), 6):g}"


def needle_code(seed: int, length: int, depth: float) -> str:
    """The cell's code: fixed by (seed, length, depth), so any subset of the grid gets the same codes."""
    rng = random.Random(f"needle:{seed}:{length}:{format_depth(depth)}")   # str seeds hash stably
    return "".join(rng.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))


def load_haystack(path: Path) -> str:
    """The novel's prose: from the first real paragraph after the Gutenberg START marker to END.

    The table of contents (short heading lines, no sentences) is skipped: needles need sentence
    boundaries near every depth.
    """
    text = path.read_bytes().decode("utf-8").replace("\r\n", "\n")
    start = text.find("*** START OF")
    end = text.find("*** END OF")
    if start < 0 or end < 0 or end <= start:
        raise NeedleError(f"{path}: expected Project Gutenberg '*** START OF' / '*** END OF' markers")
    body = text[text.index("\n", start) + 1:end]
    m = re.search(r"^[^\n]{200,}$", body, flags=re.M)      # first prose paragraph
    if m is None:
        raise NeedleError(f"{path}: no prose paragraph (a line of 200+ characters) after the START marker")
    return body[m.start():].rstrip()


@dataclass
class HaystackIndex:
    """Cumulative token counts of the haystack at piece boundaries (runner's own tokenizer).

    Inside a piece, positions are interpolated linearly by characters; exact counts always come
    from tokenizing the final prompt.
    """

    text: str
    char_marks: list[int]       # 0, c1, c2, ... (piece boundaries, in characters)
    token_marks: list[int]      # tokens of text[:char_marks[i]] (sum of piece counts)
    sentence_ends: list[int]    # character positions right after each sentence end

    @property
    def total_tokens(self) -> int:
        return self.token_marks[-1]

    def tokens_at(self, char_pos: int) -> float:
        i = bisect.bisect_right(self.char_marks, char_pos) - 1
        i = max(0, min(i, len(self.char_marks) - 2))
        c0, c1 = self.char_marks[i], self.char_marks[i + 1]
        t0, t1 = self.token_marks[i], self.token_marks[i + 1]
        return t0 + (t1 - t0) * (char_pos - c0) / max(1, c1 - c0)

    def chars_for(self, n_tokens: float) -> int:
        i = bisect.bisect_right(self.token_marks, n_tokens) - 1
        i = max(0, min(i, len(self.token_marks) - 2))
        c0, c1 = self.char_marks[i], self.char_marks[i + 1]
        t0, t1 = self.token_marks[i], self.token_marks[i + 1]
        return int(round(c0 + (c1 - c0) * (n_tokens - t0) / max(1, t1 - t0)))

    def word_cut(self, char_pos: int) -> int:
        """The end of the last whole word at or before `char_pos` (never inside a word)."""
        pos = max(1, min(char_pos, len(self.text)))
        while pos > 1 and not (not self.text[pos - 1].isspace()
                               and (pos == len(self.text) or self.text[pos].isspace())):
            pos -= 1
        return pos


async def build_index(runner: Runner, text: str, min_tokens: int, piece_chars: int = 32768) -> HaystackIndex:
    """Tokenize `text` piece by piece (cut at whitespace) until `min_tokens` are covered.

    Pieces keep HTTP tokenize requests small; a piece boundary costs at most a token of error in
    the estimate, which the exact per-prompt count corrects.
    """
    char_marks, token_marks = [0], [0]
    pos = 0
    while token_marks[-1] < min_tokens and pos < len(text):
        end = min(len(text), pos + piece_chars)
        if end < len(text):
            ws = max(text.rfind(" ", pos, end), text.rfind("\n", pos, end))
            end = ws if ws > pos else end          # the next piece starts with the space
        n = len(await runner.tokenize(text[pos:end]))
        pos = end
        char_marks.append(pos)
        token_marks.append(token_marks[-1] + n)
    ends = [m.end() for m in _SENTENCE_END.finditer(text, 0, pos)]
    return HaystackIndex(text=text[:pos], char_marks=char_marks, token_marks=token_marks,
                         sentence_ends=ends)


@dataclass
class NeedlePrompt:
    prompt: str
    prompt_tokens: int
    needle_token_position: int     # index of the needle's first token in the prompt's tokens
    needle_position_exact: bool    # tokens before the needle are a prefix of the prompt's tokens
    haystack_chars: int
    haystack_tokens_est: int
    fit_iterations: int


def _assemble(index: HaystackIndex, cut: int, depth: float, needle: str) -> tuple[str, str]:
    """(prompt, text before the needle) for a haystack cut at `cut` with the needle at `depth`."""
    hay = index.text[:cut]
    hay_tokens = index.tokens_at(cut)
    target = depth * hay_tokens
    # candidate insertion points: the start, every sentence end inside the cut, the end
    hi = bisect.bisect_right(index.sentence_ends, cut)
    points = [0] + index.sentence_ends[:hi] + [cut]
    if depth <= 0:
        b = 0
    elif depth >= 1:
        b = cut
    else:   # the sentence boundary whose estimated token position is nearest the target depth
        j = bisect.bisect_left(points, index.chars_for(target))
        cands = {points[max(0, j - 1)], points[min(j, len(points) - 1)]}
        b = min(cands, key=lambda p: abs(index.tokens_at(p) - target))
    # body is " " + hay; depth 0 puts the needle before that space (clean boundary after "Passage:")
    if b == 0:
        before = PROMPT_HEAD
        prompt = PROMPT_HEAD + needle + " " + hay + QUESTION
    else:
        before = PROMPT_HEAD + " " + hay[:b]
        prompt = before + needle + hay[b:] + QUESTION
    return prompt, before


TokenizeFn = Callable[[str], Awaitable[list[int]]]


@dataclass
class FittedText:
    cut: int              # haystack characters used
    prompt: str
    ids: list[int]        # the prompt's tokens
    error: int            # len(ids) - target
    iterations: int


async def fit_haystack(tokenize: TokenizeFn, index: HaystackIndex, target_tokens: int,
                       assemble: Callable[[int], str], fixed_tokens: int, allowed: int,
                       max_iterations: int = 8) -> FittedText:
    """Find the haystack cut (at a word end) whose assembled prompt is closest to `target_tokens`.

    `assemble(cut)` builds the whole prompt from `index.text[:cut]`; `fixed_tokens` is the prompt's
    size without haystack (for the first guess). Stops once within `allowed` tokens; returns the
    closest fit seen (the caller decides whether its error is acceptable).
    """
    best: FittedText | None = None
    cut = index.word_cut(index.chars_for(max(1, target_tokens - fixed_tokens)))
    seen: set[int] = set()
    for it in range(1, max_iterations + 1):
        prompt = assemble(cut)
        ids = await tokenize(prompt)
        err = len(ids) - target_tokens
        if best is None or abs(err) < abs(best.error):
            best = FittedText(cut, prompt, ids, err, it)
        best.iterations = it
        if abs(err) <= allowed or cut in seen:
            break
        seen.add(cut)
        # move the cut by the missing tokens, converted through the local chars-per-token rate
        new_cut = index.word_cut(index.chars_for(index.tokens_at(cut) - err))
        if new_cut == cut:          # the word snap swallowed the step: move one word
            new_cut = index.word_cut(cut - 2) if err > 0 else _next_word_end(index.text, cut)
        cut = new_cut
    assert best is not None
    return best


async def build_needle_prompt(tokenize: TokenizeFn, index: HaystackIndex, target_tokens: int,
                              depth: float, code: str, tolerance: float = LENGTH_TOLERANCE,
                              max_iterations: int = 8) -> NeedlePrompt:
    """Fit the haystack so the whole prompt has `target_tokens` (within `tolerance`), needle at `depth`."""
    cell = f"needle/{target_tokens}/{format_depth(depth)}"
    needle = NEEDLE_TEMPLATE.format(code=code)
    allowed = max(1, int(tolerance * target_tokens))
    fixed = len(await tokenize(PROMPT_HEAD + needle + QUESTION))
    want_hay = target_tokens - fixed
    if want_hay <= 0:
        raise NeedleError(f"{cell}: target {target_tokens} tokens is shorter than the prompt without "
                          f"haystack ({fixed} tokens)")
    if want_hay > index.total_tokens:
        raise NeedleError(f"{cell}: needs about {want_hay} haystack tokens, the index covers "
                          f"{index.total_tokens} (haystack too short)")
    fit = await fit_haystack(tokenize, index, target_tokens,
                             lambda cut: _assemble(index, cut, depth, needle)[0], fixed, allowed, max_iterations)
    if abs(fit.error) > allowed:
        raise NeedleError(f"{cell}: prompt has {len(fit.ids)} tokens after {fit.iterations} fits, outside "
                          f"{tolerance:.1%} of the target")
    _, before = _assemble(index, fit.cut, depth, needle)
    before_ids = await tokenize(before)
    common = 0
    for a, b in zip(before_ids, fit.ids):
        if a != b:
            break
        common += 1
    return NeedlePrompt(prompt=fit.prompt, prompt_tokens=len(fit.ids), needle_token_position=common,
                        needle_position_exact=common == len(before_ids), haystack_chars=fit.cut,
                        haystack_tokens_est=int(index.tokens_at(fit.cut)), fit_iterations=fit.iterations)


def _next_word_end(text: str, pos: int) -> int:
    n = len(text)
    while pos < n and text[pos].isspace():
        pos += 1
    while pos < n and not text[pos].isspace():
        pos += 1
    return pos


_CODE_LIKE = re.compile(r"\b[A-Z0-9]{%d}\b" % CODE_LENGTH)


def score_answer(output: str, code: str) -> tuple[bool, str]:
    """(correct, answer): exact match of the code anywhere in the output.

    answer is the code when found, else the first code-like token, else the output cut to 40 chars.
    """
    if code in output:
        return True, code
    m = _CODE_LIKE.search(output)
    return False, (m.group(0) if m else output.strip()[:40])


def _lengths_ok(v: list[int]) -> str | None:
    if not v:
        return "must list at least one length"
    return None if all(x > 0 for x in v) else "must hold positive token counts"


def _depths_ok(v: list[float]) -> str | None:
    if not v:
        return "must list at least one depth"
    return None if all(0.0 <= x <= 1.0 for x in v) else "must hold depths between 0 and 1"


class NeedleOptions(TaskOptions, total=False):
    lengths: list[int]
    depths: list[float]
    seed: int
    max_tokens: int


class NeedleCell(TypedDict):
    """One cell of the grid: the target prompt length (tokens), the needle's depth, its code."""

    length: int
    depth: float
    code: str


@dataclass(frozen=True)
class LengthFound:
    """How many cells of one length were scored, how many found the code, and the rate."""

    n: int
    found: int
    rate: float


@dataclass(frozen=True)
class NeedleSummary(AccuracySummary):
    """The accuracy figures plus the found rate per length (keys: the length as a string), the longest
    prompt asked, and how many prompts the server counted off their fitted length."""

    by_length: dict[str, LengthFound]
    max_prompt_tokens: int
    n_prompt_tokens_flagged: int

    @classmethod
    def of(cls, records: list[ItemRecord]) -> NeedleSummary:
        by_length: dict[int, list[bool]] = {}
        for r in scored(records):
            by_length.setdefault(int(r.extra["length"]), []).append(bool(r.correct))
        ok = [r for r in records if r.status == "ok"]
        return cls(*cls.counts(records),
                   by_length={str(k): LengthFound(len(v), sum(v), sum(v) / len(v))
                              for k, v in sorted(by_length.items())},
                   max_prompt_tokens=max((r.extra.get("prompt_tokens") or 0 for r in ok), default=0),
                   n_prompt_tokens_flagged=sum(1 for r in ok if r.extra.get("prompt_tokens_flagged")))


class NeedleTask(Task):
    kind = "needle"
    opts: NeedleOptions
    phase = None
    options = {
        "lengths": Field(list, item_type=int, default=lambda: list(DEFAULT_LENGTHS), check=_lengths_ok,
                         low=1, high=MAX_PROMPT_TOKENS,
                         doc="target prompt lengths in the runner's own tokens"),
        "depths": Field(list, item_type=float, default=lambda: list(DEFAULT_DEPTHS), check=_depths_ok,
                        low=0.0, high=1.0,
                        doc="needle depths, 0 = start of the haystack, 1 = end"),
        "seed": Field(int, default=1234, low=0, high=MAX_SEED, doc="seeds the per-cell codes"),
        "max_tokens": Field(int, default=32, check=positive, low=1, high=MAX_NEW_TOKENS, doc="answer length cap"),
    }

    def __init__(self, opts: NeedleOptions, ctx: TaskContext):
        opts = {**{k: (f.default() if callable(f.default) else f.default)
                   for k, f in self.options.items()}, **opts}
        super().__init__(opts, ctx)
        self.lengths = [int(x) for x in dict.fromkeys(opts["lengths"])]
        self.depths = [float(x) for x in dict.fromkeys(round(float(d), 6) for d in opts["depths"])]
        self.seed = int(opts["seed"])
        self.max_tokens = int(opts["max_tokens"])
        self.index: HaystackIndex | None = None

    def needs(self, runner: Runner) -> set[str]:
        return {Capability.GENERATE, Capability.TOKENIZE}

    def items(self) -> list[Item[NeedleCell]]:
        out = []
        for length in self.lengths:
            for depth in self.depths:
                out.append(Item(f"needle/{length}/{format_depth(depth)}",
                                NeedleCell(length=length, depth=depth, code=needle_code(self.seed, length, depth))))
        return self._cut(out)

    async def prepare(self, runner: Runner) -> None:
        path = data_file(self.ctx.data_dir, HAYSTACK_FILE)
        register(self.ctx.data_files, Path(self.ctx.data_dir), path)
        text = load_haystack(path)
        longest = max((it.data["length"] for it in self.items()), default=0)
        # margin: the fit may overshoot the estimate by a few percent before correcting
        self.index = await build_index(runner, text, int(longest * 1.05) + 1024)

    async def evaluate(self, item: Item[NeedleCell], runner: Runner) -> ItemRecord:
        if self.index is None:
            await self.prepare(runner)
        assert self.index is not None
        length, depth, code = item.data["length"], item.data["depth"], item.data["code"]
        if runner.concurrency <= 1:
            self.ctx.mark("prepare")         # fitting the prompt with the tokenizer: host work, not idle
        built = await build_needle_prompt(runner.tokenize, self.index, length, depth, code)
        stream = Capability.STREAM in runner.capabilities
        request = GenerateRequest(prompt=built.prompt, max_tokens=self.max_tokens, temperature=0.0,
                                  stream=stream, cache_prompt=False)
        alone = runner.concurrency <= 1      # phase marks only mean something with one request in flight
        if alone:
            self.ctx.mark("prefill")
        t0 = time.perf_counter()
        result = await runner.generate(request)
        wall = time.perf_counter() - t0
        probe = self.ctx.probe
        if alone and probe is not None:
            if result.token_times and hasattr(probe, "count_tokens"):   # the NVML probe: late marks, J/token
                probe.mark("decode", at=t0 + result.token_times[0])
                probe.count_tokens(prefill=built.prompt_tokens, decode=len(result.token_times))
            self.ctx.mark("idle")
        correct, answer = score_answer(result.text, code)
        extra = {
            **runner_fields(result),
            "prompt_hash": prompt_hash(built.prompt),
            "prompt_tokens": built.prompt_tokens,          # our exact count, runner's tokenizer
            "runner_prompt_tokens": result.prompt_tokens,  # what the backend reported, if anything
            **prompt_tokens_check(built.prompt_tokens, result.prompt_tokens),
            "length": length, "depth": depth,
            "needle_token_position": built.needle_token_position,
            "needle_position_exact": built.needle_position_exact,
            "needle_depth_actual": built.needle_token_position / max(1, built.prompt_tokens),
            "fit_iterations": built.fit_iterations,
            "wall_s": wall,
        }
        if result.token_times:
            ttft = result.token_times[0]
            extra["ttft_s"] = ttft
            extra["prefill_tok_s"] = built.prompt_tokens / ttft if ttft > 0 else None
        for key in ("prompt_ms", "prompt_per_second"):      # llama-server style timings, when given
            if key in (result.timings or {}):
                extra[key] = result.timings[key]
        return self.record(item, correct=correct, answer=answer, reference=code, output=result.text, extra=extra)

    def summary(self, records: list[ItemRecord]) -> NeedleSummary:
        return NeedleSummary.of(records)
