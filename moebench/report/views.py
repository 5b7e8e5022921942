"""What the report templates read: one dataclass per report and per part of a report.

The builders in render.py, rig.py, load.py and trend.py parse the store's files (compare.json's
sections, manifest.json, items.jsonl, gate.json, matrix.json) into these; the templates read their
fields by name. A field typed `JsonValue` holds a figure shown as the file wrote it (the `num`
filter formats numbers and shows anything else as text), so the report never rounds or drops what a
writer put there.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal, NamedTuple, TypeVar

from markupsafe import Markup

from moebench.json_fields import as_object
from moebench.json_types import JsonObject, JsonValue
from moebench.store.records import ItemRecord


class ReportError(ValueError):
    """The input is neither a run nor a compare directory, or one of its files is malformed."""


class Figure(NamedTuple):
    """A titled plot: the SVG that plots.py drew (it escapes its own labels)."""

    title: str
    svg: Markup


Interval = tuple[float, float]
IdentityPairs = list[tuple[str, str]]     # the manifest's fields as (key, text) for a folded table


_Row = TypeVar("_Row", bound="KeyedFigures")


class KeyedFigures:
    """A dataclass of figures shown as written, each read from the JSON key of its own name (a key
    that is absent reads as None, shown as "–")."""

    @classmethod
    def from_json(cls: type[_Row], data: JsonValue) -> _Row:
        d = as_object(data)
        return cls(**{f.name: d.get(f.name) for f in fields(cls)})  # type: ignore[call-arg, arg-type]


# --- shared --------------------------------------------------------------------------------------

@dataclass
class TaskSummary:
    """A task's row of the verdict and accuracy tables (also a subject's, and the all-tasks row)."""

    task: str
    n_paired: int | None
    wins: int
    losses: int
    excluded: int
    baseline_correct: int | None = None
    baseline_accuracy: float | None = None
    baseline_ci: Interval | None = None
    candidate_correct: int | None = None
    candidate_accuracy: float | None = None
    candidate_ci: Interval | None = None
    flip_rate: float | None = None
    mcnemar_p: float | None = None
    delta_ci: Interval | None = None
    delta: float | None = None


@dataclass
class GateCheck:
    """gate.json checks[]: one rule's value against its limit."""

    section: JsonValue
    rule: JsonValue
    value: JsonValue
    limit: JsonValue
    verdict: JsonValue
    message: JsonValue


@dataclass
class GateView:
    """gate.json (docs/schema.md): the verdict, its exit code, the rules file and every check."""

    verdict: str
    exit_code: JsonValue
    rules_file: JsonValue
    checks: list[GateCheck]

    @classmethod
    def from_json(cls, data: JsonObject, source: str) -> GateView:
        """gate.json as the gate writes it; a missing key is a ReportError naming file and key."""
        def need(d: JsonObject, key: str, where: str) -> JsonValue:
            if key not in d:
                raise ReportError(f"{source}: {where}missing key {key!r}")
            return d[key]
        verdict = need(data, "verdict", "")
        if not isinstance(verdict, str):
            raise ReportError(f"{source}: key 'verdict' should be a string, got {type(verdict).__name__}")
        checks = []
        for i, c in enumerate(data.get("checks") or []):
            if not isinstance(c, dict):
                raise ReportError(f"{source}: checks[{i}] should be an object, got {type(c).__name__}")
            where = f"checks[{i}]: "
            checks.append(GateCheck(section=need(c, "section", where), rule=need(c, "rule", where),
                                    value=need(c, "value", where), limit=need(c, "limit", where),
                                    verdict=need(c, "verdict", where), message=need(c, "message", where)))
        return cls(verdict=verdict, exit_code=need(data, "exit_code", ""), rules_file=need(data, "rules_file", ""),
                   checks=checks)


# --- a single run --------------------------------------------------------------------------------

@dataclass
class RunTaskSummary:
    """A task of one run: items, errors, scored, correct and the accuracy with its Wilson interval."""

    task: str
    n: int
    ok: int
    errors: int
    scored: int
    correct: int
    accuracy: float | None
    ci: Interval | None


@dataclass
class RunItemRow:
    """One item of a run's items table."""

    kind: Literal["error", "correct", "wrong", "unscored"]
    task: str
    item_id: str
    question: str
    question_excerpt: str
    question_code: str | None
    reference: JsonValue
    answer: JsonValue
    output: str
    error: JsonValue
    status: str


@dataclass
class ItemCounts:
    """How many of a run's items are of each kind (the filter buttons)."""

    correct: int
    wrong: int
    error: int
    unscored: int


# --- compare: sides, flips and the verdict -------------------------------------------------------

@dataclass
class SideView:
    """One side of a compare: its run, label, the manifest's identity and its records by key."""

    role: str
    label: str
    run: str | None
    found: bool = False
    identity: IdentityPairs = field(default_factory=list)
    records: dict[tuple[str, str], ItemRecord] = field(default_factory=dict)


@dataclass
class FlipRow:
    """One paired item: win, loss, same-right or same-wrong, with both sides' answers and outputs."""

    kind: Literal["win", "loss", "same-right", "same-wrong"]
    item_id: str
    question: str
    question_excerpt: str
    question_code: str | None
    reference: JsonValue
    baseline_answer: JsonValue
    candidate_answer: JsonValue
    baseline_output: str
    candidate_output: str
    missing: list[str]


@dataclass
class FlipCounts:
    win: int
    loss: int
    same_right: int
    same_wrong: int


@dataclass
class FlipTable:
    """A task's items table with its notes, excluded items and per-subject rows."""

    task: str
    rows: list[FlipRow]
    notes: list[str]
    excluded: list[tuple[str, str]]
    subjects: list[TaskSummary]
    counts: FlipCounts


@dataclass
class VerdictFigure:
    """A row of the verdict's figures: baseline, candidate, ratio and which way it went, as text."""

    label: str
    baseline: str
    candidate: str
    ratio: str
    reading: str


@dataclass
class VerdictView:
    """The opening tables: per task accuracy and flips, the headline figures, notes, no-gate line."""

    tasks: list[TaskSummary]
    overall: TaskSummary | None
    figures: list[VerdictFigure]
    notes: list[str]
    no_gate: str | None


# --- compare: KLD and needle ---------------------------------------------------------------------

@dataclass
class KldStat:
    key: str
    label: str
    value: JsonValue
    err: JsonValue


@dataclass
class KldDeltaP:
    key: str
    value: JsonValue


@dataclass
class KldTool:
    """The llama-perplexity build that scored the candidate: binary, version, flags and commands."""

    binary: JsonValue
    version: JsonValue
    source: JsonValue
    args: str
    dropped: str
    commands: list[str]


@dataclass
class SkewRow:
    layer: int
    baseline: JsonValue
    candidate: JsonValue


@dataclass
class KldView:
    """The teacher-forced KLD: statistics, Δp, plots, the method, the tool and the load skew."""

    stats: list[KldStat]
    delta_p: list[KldDeltaP]
    plots: list[Figure]
    method: JsonValue = None
    method_note: JsonValue = None
    tool: KldTool | None = None
    skew_rows: list[SkewRow] | None = None


@dataclass
class KldSampledView:
    """The sampled KLD: estimate, interval, the other estimator and counts."""

    mean: JsonValue
    interval: list[JsonValue]
    estimator: JsonValue
    confidence: JsonValue
    n_tokens: JsonValue
    n_sequences: JsonValue
    n_prompts: JsonValue
    other_name: str
    other_mean: JsonValue
    other_interval: list[JsonValue] | None
    beside_teacher_forced: bool
    note: JsonValue


@dataclass
class NeedleView:
    """The needle grid: counts, the SVG and the prompts the server counted off the fitted length."""

    counts: dict[str, int]
    svg: Markup
    flagged: dict[str, list[str]]


# --- compare: speed ------------------------------------------------------------------------------

@dataclass
class MetricCell:
    """One speed metric of a row: baseline, candidate, their ratio and its interval."""

    baseline: float | None
    candidate: float | None
    ratio: float | None
    ratio_ci95: list[float | None] | None


@dataclass
class SpeedRow:
    """One prompt length (and client count) of the speed table."""

    prompt_length: int | None
    clients: int | None
    n_baseline: int | None
    n_candidate: int | None
    metrics: dict[str, MetricCell]
    acceptance_baseline: float | None
    acceptance_candidate: float | None


@dataclass
class Percentiles(KeyedFigures):
    """A metric's sample count and p50 / p90 / p99 on one side, as compare.json wrote them."""

    n: JsonValue = None
    p50: JsonValue = None
    p90: JsonValue = None
    p99: JsonValue = None


@dataclass
class PercentileRow:
    prompt_length: int | None
    clients: int | None
    metric: str
    baseline: Percentiles
    candidate: Percentiles


@dataclass
class SpeedView:
    """Speed against context: rows, the metrics present, plots, percentiles, sampling, acceptance."""

    rows: list[SpeedRow]
    metrics: list[str]
    plots: list[Figure]
    show_clients: bool
    labels: dict[str, str]
    higher_better: tuple[str, ...]
    geomean: list[tuple[str, JsonValue]]
    percentiles: list[PercentileRow]
    sampling: list[tuple[str, str]]
    acceptance: bool


@dataclass
class AbRoundRow(KeyedFigures):
    """speed_ab.rounds[]: one round of A and B passes, their decode speeds and ratios, the winner."""

    round: JsonValue = None
    a_pass: JsonValue = None
    b_pass: JsonValue = None
    n_pairs: JsonValue = None
    a_decode_tok_s: JsonValue = None
    b_decode_tok_s: JsonValue = None
    decode_tok_s_ratio: JsonValue = None
    prefill_tok_s_ratio: JsonValue = None
    ttft_s_ratio: JsonValue = None
    winner: JsonValue = None


@dataclass
class AbPaired:
    """speed_ab.paired[metric]: the median B/A ratio over every round, its interval and pairs."""

    median_ratio: JsonValue
    ratio_ci95: JsonValue
    n_pairs: JsonValue


@dataclass
class AbIdentity:
    """speed_ab.identity: how many prompts' outputs differ between A and B passes (and within each)."""

    n_pairs: int
    compared_on: JsonValue
    n_differ: JsonValue
    n_compared: JsonValue
    a_self_n_differ: JsonValue
    b_self_n_differ: JsonValue


@dataclass
class SpeedAbView:
    """The A/B speed rounds: order, profiles, rounds won, each round, the paired ratios, identity."""

    rounds: list[AbRoundRow]
    order: JsonValue
    profile_a: JsonValue
    profile_b: JsonValue
    won_a: JsonValue
    won_b: JsonValue
    won_tie: JsonValue
    paired: list[tuple[str, AbPaired]]
    identity: AbIdentity | None
    metric: JsonValue


# --- compare: serving load -----------------------------------------------------------------------

@dataclass
class Tail:
    """A latency percentile with its sample count and whether it is only indicative."""

    value: float | None
    indicative: bool
    n: JsonValue
    needs: JsonValue


@dataclass
class LoadSide:
    """One side of a serving-load group: goodput, SLO share, counts, tails and the server's state."""

    goodput: float | None
    share: float | None
    n: JsonValue
    errors: JsonValue
    achieved: float | None
    client_limited: bool
    ttft_p90: Tail
    ttft_p99: Tail
    tpot_p99: Tail
    server: list[tuple[str, str]] | None
    server_source: JsonValue
    server_samples: JsonValue
    slos: list[tuple[str, JsonValue]]


@dataclass
class LoadRow:
    """One offered rate at one prompt length, both sides, and the goodput ratio with its interval."""

    prompt_length: JsonValue
    rate: float | None
    skipped: bool
    ratio: float | None
    ci: list[JsonValue] | None
    baseline: LoadSide
    candidate: LoadSide


@dataclass
class SweepLine:
    """Where one side's rate sweep at one prompt length stopped."""

    role: str
    prompt_length: str
    rates_run: list[JsonValue]
    stop_reason: JsonValue
    stopped_at_rate: JsonValue
    saturation_rate: JsonValue


@dataclass
class LoadView:
    """The serving-load part: rows, the goodput plot, SLOs, sweeps, the early-stopping sample needs."""

    rows: list[LoadRow]
    plot: Markup
    slos: list[tuple[str, JsonValue]]
    sweeps: list[SweepLine]
    needs_p90: JsonValue
    needs_p99: JsonValue
    interval: JsonValue
    server: bool
    server_labels: list[str]


# --- compare: memory and energy ------------------------------------------------------------------

@dataclass
class RawFigures:
    """Every figure of a section under its flattened compare.json key, a column per side."""

    names: list[str]
    values: dict[str, dict[str, JsonValue]]
    columns: list[str]


@dataclass
class MemoryRow:
    """A readable memory figure in GiB per side, the ratio and which way is better."""

    label: str
    baseline: str
    candidate: str
    ratio: float | None
    better: str


@dataclass
class MemoryView:
    rows: list[MemoryRow]
    note: str | None
    available: bool
    plots: list[Figure]
    raw: RawFigures | None


@dataclass
class EnergyTokenRow:
    """J/token of one work phase (net or gross) per side and their ratio."""

    label: str
    baseline: JsonValue
    candidate: JsonValue
    ratio: JsonValue


@dataclass
class EnergyPhaseRow:
    """A phase's duration, energy, net energy and mean power per side (b_ baseline, c_ candidate)."""

    phase: str
    b_s: JsonValue
    c_s: JsonValue
    b_j: JsonValue
    c_j: JsonValue
    j_ratio: float | None
    b_net: JsonValue
    c_net: JsonValue
    b_w: JsonValue
    c_w: JsonValue


@dataclass
class IdlePower:
    baseline: JsonValue
    candidate: JsonValue


@dataclass
class EnergyView:
    available: bool
    note: str | None
    per_token: list[EnergyTokenRow]
    phases: list[EnergyPhaseRow]
    idle: IdlePower | None
    raw: RawFigures | None


# --- rig: cards, torch memory, energy by phase, engine tiers -------------------------------------

@dataclass
class CardRow:
    """One card (or the sum) of one side: memory and whole-run energy by counter and by integral."""

    card: str
    side: str
    peak_used_bytes: JsonValue
    min_free_bytes: JsonValue
    reserved_bytes: JsonValue
    idle_power_w: JsonValue
    counter_j: JsonValue
    integral_j: JsonValue
    rel_diff: JsonValue


@dataclass
class TorchRow:
    """torch's peak allocated / reserved in one engine phase, NVML's peak used of the run beside."""

    side: str
    phase: str
    allocated: JsonValue
    reserved: JsonValue
    nvml_peak_used: JsonValue


@dataclass
class RigPhaseRow:
    """A probe phase's duration, energy, net energy and mean power on each side."""

    phase: str
    baseline_s: JsonValue = None
    baseline_j: JsonValue = None
    baseline_net_j: JsonValue = None
    baseline_w: JsonValue = None
    candidate_s: JsonValue = None
    candidate_j: JsonValue = None
    candidate_net_j: JsonValue = None
    candidate_w: JsonValue = None


@dataclass
class TierTotals(KeyedFigures):
    """The engine's tier counters summed over layers (compare.json engine.<side>.tiers.total)."""

    routed: JsonValue = None
    picks_gpu: JsonValue = None
    picks_host: JsonValue = None
    host_hits: JsonValue = None
    host_misses: JsonValue = None
    prefetch_hits: JsonValue = None
    host_direct: JsonValue = None
    route_tail_skips: JsonValue = None
    host_hit_rate: JsonValue = None
    bytes_h2d: JsonValue = None
    copy_wait_s: JsonValue = None


@dataclass
class EngineSide:
    side: str
    choices: list[tuple[str, JsonValue]]
    decode_steps: JsonValue
    decode_tok_s: JsonValue
    total: TierTotals | None


@dataclass
class EngineView:
    sides: list[EngineSide]
    plots: list[Figure]


@dataclass
class RigView:
    """Everything the rig sections show."""

    cards: list[CardRow]
    torch: list[TorchRow]
    phases: list[RigPhaseRow]
    phase_sides: list[str]
    headlines: dict[str, JsonValue]
    engine: EngineView | None


# --- the reports ---------------------------------------------------------------------------------

@dataclass(kw_only=True)
class RunReport:
    """The report of one run directory."""

    title: str
    run_path: str
    identity: IdentityPairs
    summaries: list[RunTaskSummary]
    accuracy_svg: Markup | None
    rows: list[RunItemRow]
    counts: ItemCounts
    rig: RigView | None
    mode: Literal["run"] = "run"


@dataclass(kw_only=True)
class CompareReport:
    """The report of one compare directory."""

    title: str
    compare_path: str
    sides: list[SideView]
    warnings: list[str]
    tasks: list[TaskSummary]
    accuracy_svg: Markup | None
    overall: TaskSummary | None
    flips: list[FlipTable]
    kld: KldView | None
    kld_sampled: KldSampledView | None
    needle: NeedleView | None
    speed: SpeedView | None
    speed_ab: SpeedAbView | None
    load: LoadView | None
    memory: MemoryView | None
    energy: EnergyView | None
    rig: RigView | None
    gate: GateView | None
    verdict: VerdictView
    mode: Literal["compare"] = "compare"


@dataclass
class MatrixFigures:
    """matrix.json rows[]: the figures of one candidate the several-candidates table shows."""

    candidate: JsonValue
    model_bytes: JsonValue
    kld_mean: JsonValue
    kld_same_top_p: JsonValue
    decode_ratio: JsonValue
    prefill_ratio: JsonValue
    peak_used_bytes: JsonValue
    decode_j_per_token: JsonValue

    @classmethod
    def from_json(cls, r: JsonObject) -> MatrixFigures:
        return cls(candidate=r.get("candidate"), model_bytes=r.get("model_bytes"), kld_mean=r.get("kld.mean"),
                   kld_same_top_p=r.get("kld.same_top_p"), decode_ratio=r.get("speed.decode_ratio"),
                   prefill_ratio=r.get("speed.prefill_ratio"), peak_used_bytes=r.get("memory.peak_used_bytes"),
                   decode_j_per_token=r.get("energy.decode_j_per_token"))


@dataclass
class MatrixTaskCell:
    """One task of one candidate: Δ with its interval, wins and losses."""

    delta: JsonValue
    delta_ci_low: JsonValue
    delta_ci_high: JsonValue
    wins: JsonValue
    losses: JsonValue


@dataclass
class MatrixColumn:
    """One candidate's column: its figures, the link to its own report, its gate and task cells."""

    row: MatrixFigures
    link: str | None
    gate: GateView | None
    tasks: list[MatrixTaskCell]


@dataclass
class ManifestFold:
    """A run's manifest fields, folded at the end of the several-candidates report."""

    role: str
    label: JsonValue
    run: JsonValue
    identity: IdentityPairs


@dataclass(kw_only=True)
class MatrixReport:
    """The report over several candidates against one baseline."""

    title: str
    compare_path: str
    warnings: list[str]
    candidates: list[MatrixColumn]
    tasks: list[str]
    scatter: Markup
    manifests: list[ManifestFold]
    mode: Literal["matrix"] = "matrix"


@dataclass
class TrendRunRow:
    """A run of the trend's table: its label, build and start time."""

    label: str
    build: str
    started_at: str | None


@dataclass(kw_only=True)
class TrendReport:
    """trend.html: the runs in order and a chart per figure."""

    title: str
    trend_path: str
    order_by: str
    warnings: list[str]
    runs: list[TrendRunRow]
    figures: list[Figure]
    mode: Literal["trend"] = "trend"
