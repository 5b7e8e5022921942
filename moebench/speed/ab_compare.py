"""compare.json["speed_ab"]: interleaved A/B speed passes (`moebench speed-ab`) as rounds, paired ratios
and output identity. B is the candidate, A the baseline.

Every pass times the same prompts (the prefixes are seeded per measurement), so measurements pair by
item id across passes. Round k pairs the k-th A pass with the k-th B pass (A,B,B,A gives rounds
(pass 0, pass 1) and (pass 3, pass 2)); a round's ratio is the median over its prompts of B/A, and
its winner is the side with the faster decode. Over all rounds, the median paired ratio gets a 95%
bootstrap interval (prompts resampled).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from moebench.json_types import JsonObject, JsonValue
from moebench.scoring.stats import bootstrap_paired_ratio_ci
from moebench.json_fields import Fields
from moebench.speed.stored import StoredRequest

AB_METRICS = ("decode_tok_s", "prefill_tok_s", "ttft_s", "tpot_s")
# the figure that decides a round; higher is faster
ROUND_METRIC = "decode_tok_s"


def _value(r: StoredRequest, metric: str) -> float | None:
    v = r.times.metric(metric)
    return float(v) if v is not None and v > 0 else None


@dataclass(frozen=True)
class AbPass:
    """One A/B pass: which side, where it stood in the order, its process, and the speed records that
    process wrote with their ok and error counts (its summary's n_ok and n_errors)."""

    which: str                        # "A" or "B"
    index: int                        # its place in the order, from 0
    pid: int
    load_s: float                     # the runner's start-up
    process_s: float                  # the whole process, start-up included
    records: list[StoredRequest]
    n_ok: int
    n_errors: int

    def ok(self) -> dict[str, StoredRequest]:
        """The ok records by item id (a measurement pairs by item id across passes)."""
        return {r.item_id: r for r in self.records if r.ok}

    def to_json(self) -> JsonObject:
        """The pass as ab.json lists it."""
        return {"pass": self.index, "which": self.which, "pid": self.pid, "load_s": self.load_s,
                "process_s": self.process_s, "n_ok": self.n_ok, "n_errors": self.n_errors}


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


@dataclass(frozen=True)
class RoundFigure:
    """One metric of a round: each side's median over the round's paired prompts, and the median B/A."""

    a: float | None
    b: float | None
    ratio: float | None


@dataclass(frozen=True)
class AbRound:
    """Round k: the k-th A pass against the k-th B pass, per metric of AB_METRICS, and who won."""

    round: int
    a_pass: int
    b_pass: int
    n_pairs: int
    figures: dict[str, RoundFigure]      # metric -> figure, in AB_METRICS order

    @property
    def winner(self) -> str | None:
        """The side with the faster ROUND_METRIC (higher is faster), "tie", or None without pairs."""
        ratio = self.figures[ROUND_METRIC].ratio
        return None if ratio is None else ("B" if ratio > 1 else "A" if ratio < 1 else "tie")

    def to_json(self) -> JsonObject:
        out: JsonObject = {"round": self.round, "a_pass": self.a_pass, "b_pass": self.b_pass,
                               "n_pairs": self.n_pairs}
        for m, f in self.figures.items():
            out[f"a_{m}"], out[f"b_{m}"], out[f"{m}_ratio"] = f.a, f.b, f.ratio
        out["winner"] = self.winner
        return out

    @staticmethod
    def from_json(f: Fields) -> AbRound:
        """A stored round (its winner follows from the figures)."""
        return AbRound(f.need_int("round"), f.need_int("a_pass"), f.need_int("b_pass"), f.integer("n_pairs") or 0,
                       {m: RoundFigure(f.num(f"a_{m}"), f.num(f"b_{m}"), f.num(f"{m}_ratio")) for m in AB_METRICS})


@dataclass(frozen=True)
class PairedRatio:
    """One metric's median B/A ratio over every prompt of every round, its 95% interval and count."""

    median_ratio: float | None
    ratio_ci95: tuple[float, float] | None
    n_pairs: int

    def to_json(self) -> JsonObject:
        return {"median_ratio": self.median_ratio, "ratio_ci95": list(self.ratio_ci95) if self.ratio_ci95 else None,
                "n_pairs": self.n_pairs}

    @staticmethod
    def from_json(f: Fields) -> PairedRatio:
        return PairedRatio(f.num("median_ratio"), f.interval("ratio_ci95"), f.integer("n_pairs") or 0)


def rounds(passes: list[AbPass]) -> list[AbRound]:
    """One entry per round, in the order the passes ran."""
    a = [p for p in passes if p.which == "A"]
    b = [p for p in passes if p.which == "B"]
    out = []
    for k, (pa, pb) in enumerate(zip(a, b), start=1):
        ra, rb = pa.ok(), pb.ok()
        common = sorted(set(ra) & set(rb))
        figures = {}
        for m in AB_METRICS:
            ratios = [vb / va for i in common
                      if (va := _value(ra[i], m)) is not None and (vb := _value(rb[i], m)) is not None]
            figures[m] = RoundFigure(_median([v for i in common if (v := _value(ra[i], m)) is not None]),
                                     _median([v for i in common if (v := _value(rb[i], m)) is not None]),
                                     _median(ratios))
        out.append(AbRound(k, pa.index, pb.index, len(common), figures))
    return out


def paired_ratios(passes: list[AbPass], n_boot: int = 2000) -> dict[str, PairedRatio]:
    """Per metric: the median B/A ratio over every prompt of every round, its interval and count."""
    a = [p for p in passes if p.which == "A"]
    b = [p for p in passes if p.which == "B"]
    out: dict[str, PairedRatio] = {}
    for m in AB_METRICS:
        ratios: list[float] = []
        for pa, pb in zip(a, b):
            ra, rb = pa.ok(), pb.ok()
            for i in sorted(set(ra) & set(rb)):
                va, vb = _value(ra[i], m), _value(rb[i], m)
                if va is not None and vb is not None:
                    ratios.append(vb / va)
        ci = bootstrap_paired_ratio_ci(ratios, n_boot=n_boot)
        out[m] = PairedRatio(_median(ratios), ci, len(ratios))
    return out


def _output_key(r: StoredRequest) -> tuple[str, tuple[int, ...] | str | None]:
    ids = r.output_token_ids
    return ("token_ids", tuple(ids)) if ids else ("text", r.output)


@dataclass(frozen=True)
class PairIdentity:
    """One A pass against one B pass: prompts both answered, and how many of those answers differ."""

    a_pass: int
    b_pass: int
    n_compared: int
    n_differ: int

    def to_json(self) -> JsonObject:
        return {"a_pass": self.a_pass, "b_pass": self.b_pass, "n_compared": self.n_compared,
                "n_differ": self.n_differ}

    @staticmethod
    def from_json(f: Fields) -> PairIdentity:
        return PairIdentity(f.need_int("a_pass"), f.need_int("b_pass"), f.need_int("n_compared"),
                            f.need_int("n_differ"))


@dataclass(frozen=True)
class SelfIdentity:
    """One side's passes against each other: the most prompts a pair compared, and how many differ."""

    n_compared: int
    n_differ: int


@dataclass(frozen=True)
class OutputIdentity:
    """Outputs of A and B for the same prompts: prompts in every pass compared, those differing in any
    A/B pair, each pair's counts, and each side with itself where it ran more than once."""

    n_compared: int
    differ: list[str]                 # item ids, sorted
    pairs: list[PairIdentity]
    compared_on: str                  # "token_ids" or "text"
    a_self: SelfIdentity | None
    b_self: SelfIdentity | None

    def to_json(self) -> JsonObject:
        out: JsonObject = {"n_compared": self.n_compared, "n_differ": len(self.differ),
                           "n_differ_any": len(self.differ), "differ": list(self.differ),
                           "pairs": [p.to_json() for p in self.pairs], "compared_on": self.compared_on}
        for name, own in (("a_self", self.a_self), ("b_self", self.b_self)):
            if own is not None:
                out[f"{name}_n_compared"], out[f"{name}_n_differ"] = own.n_compared, own.n_differ
        return out

    @staticmethod
    def from_json(f: Fields) -> OutputIdentity:
        def own(name: str) -> SelfIdentity | None:
            n = f.integer(f"{name}_n_compared")
            return SelfIdentity(n, f.integer(f"{name}_n_differ") or 0) if n is not None else None
        return OutputIdentity(f.integer("n_compared") or 0, f.strings("differ") or [],
                              [PairIdentity.from_json(p) for p in f.objects("pairs")],
                              f.text("compared_on") or "text", own("a_self"), own("b_self"))


def output_identity(a_passes: list[AbPass], b_passes: list[AbPass]) -> OutputIdentity:
    """Outputs for the same prompts compared over EVERY A pass against EVERY B pass, and each side with itself.

    `n_differ` (= `n_differ_any`) counts prompts whose outputs differ in at least one A/B pair;
    `n_compared` the prompts present in every pass compared.
    """
    def diff(x: AbPass, y: AbPass) -> tuple[set[str], set[str], set[str]]:
        a, b = x.ok(), y.ok()
        common = set(a) & set(b)
        differ = {i for i in common if _output_key(a[i]) != _output_key(b[i])}
        return common, differ, {_output_key(a[i])[0] for i in common}

    def with_itself(side: list[AbPass]) -> SelfIdentity | None:
        if len(side) < 2:        # a backend that is not deterministic with itself explains A/B differences
            return None
        n_cmp, d_all = 0, set()
        for i in range(len(side)):
            for j in range(i + 1, len(side)):
                common, d, _ = diff(side[i], side[j])
                n_cmp = max(n_cmp, len(common))
                d_all |= d
        return SelfIdentity(n_cmp, len(d_all))

    pairs, differ_any, basis = [], set(), set()
    compared: set[str] | None = None
    for pa in a_passes:
        for pb in b_passes:
            common, differ, kinds = diff(pa, pb)
            pairs.append(PairIdentity(pa.index, pb.index, len(common), len(differ)))
            differ_any |= differ
            basis |= kinds
            compared = common if compared is None else compared & common
    return OutputIdentity(len(compared or ()), sorted(differ_any), pairs,
                          "token_ids" if basis == {"token_ids"} else "text",
                          with_itself(a_passes), with_itself(b_passes))


MEANING = ("B (candidate) / A (baseline); a round is the k-th A pass with the k-th B pass; "
           "the faster decode wins it")


@dataclass(frozen=True)
class AbSection:
    """compare.json["speed_ab"]: the order and profiles, the rounds and who won them, the paired ratios
    per metric and the output identity of A and B."""

    order: str
    profiles: dict[str, str]          # "A"/"B" -> profile path
    rounds: list[AbRound]
    paired: dict[str, PairedRatio]    # AB_METRICS order
    identity: OutputIdentity

    def to_json(self) -> JsonObject:
        return {"order": self.order, "profiles": dict(self.profiles), "round_metric": ROUND_METRIC,
                "rounds": [r.to_json() for r in self.rounds], "rounds_won": self.rounds_won,
                "paired": {m: p.to_json() for m, p in self.paired.items()},
                "identity": self.identity.to_json(), "meaning": MEANING}

    @staticmethod
    def from_json(obj: JsonValue, source: str) -> AbSection:
        """compare.json speed_ab (or ab.json's) read back; refused naming `source` and the key."""
        f = Fields(obj, source)
        profiles, paired, identity = f.at("profiles"), f.at("paired"), f.at("identity")
        return AbSection(
            f.text("order") or "", {k: profiles.need_str(k) for k in profiles.obj} if profiles else {},
            [AbRound.from_json(r) for r in f.objects("rounds")],
            {m: PairedRatio.from_json(p) for m in AB_METRICS if paired and (p := paired.at(m)) is not None},
            OutputIdentity.from_json(identity) if identity else OutputIdentity(0, [], [], "text", None, None))

    @property
    def rounds_won(self) -> dict[str, int]:
        return {side: sum(1 for r in self.rounds if r.winner == side) for side in ("A", "B", "tie")}


def ab_section(passes: list[AbPass], order: str, profiles: dict[str, str], n_boot: int = 2000) -> AbSection:
    return AbSection(order, profiles, rounds(passes), paired_ratios(passes, n_boot=n_boot),
                     output_identity([p for p in passes if p.which == "A"], [p for p in passes if p.which == "B"]))


def format_rounds(section: JsonValue, source: str = "speed_ab") -> str:
    """compare.json speed_ab (as read; parsed here) as text: `format_ab_section`."""
    return format_ab_section(AbSection.from_json(section, source))


def format_ab_section(section: AbSection) -> str:
    """The rounds as text lines, in the order they ran, plus the tally and the paired ratio."""
    lines = []
    for r in section.rounds:
        f = r.figures[ROUND_METRIC]
        lines.append(f"round {r.round}: A pass {r.a_pass} {_f(f.a)} tok/s, B pass {r.b_pass} {_f(f.b)} tok/s, "
                     f"B/A {_f(f.ratio, 4)} -> {r.winner or 'no result'}")
    won = section.rounds_won
    p = section.paired.get(ROUND_METRIC)
    ci = p.ratio_ci95 if p else None
    lines.append(f"rounds won: B {won['B']}, A {won['A']}, tied {won['tie']} of "
                 f"{len(section.rounds)}; median paired decode ratio B/A {_f(p.median_ratio if p else None, 4)}"
                 + (f" [{_f(ci[0], 4)}, {_f(ci[1], 4)}]" if ci else "") + f" over {p.n_pairs if p else 0} prompts")
    return "\n".join(lines)


def _f(v: float | None, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}g}"
