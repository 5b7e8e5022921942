"""How an `Engine` decodes: one frozen `DecodeConfig` per engine, handed to every kernel call.

Everything that picks a code path or a launch shape lives here: which experts implementation runs,
whether the fused decode ops run, how packed expert rows are decoded (`DecodeMode`, per `Format`),
the fusions and stream overlaps of a decode step, and the kernels' launch tables. Two engines in one
process can differ in any of it; `DecodeConfig.identity()` is what a run manifest records.

    cfg = DecodeConfig(experts_impl="triton", int8_activations=True)
    cfg = cfg.with_launch("gate_up", "int4", BN=8, BK=512)      # a new config; cfg is frozen
    Engine.load(path, device="cuda", decode=cfg)
"""
from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any, Mapping

GROUP = 64        # columns per quantization group (quant.GROUP); a launch step covers whole groups


class DecodeConfigError(ValueError):
    """A decode setting out of range; the message names the setting and what was expected."""


class Format(enum.IntEnum):
    """Storage format of a stacked expert matrix; the value is the kernels' FMT constexpr."""

    DENSE = 0
    INT8 = 1
    INT4 = 2
    INT4_ASYM = 3
    TERNARY = 4
    TERNARY2 = 5

    @property
    def key(self) -> str:
        """The format's name in quant.py and in launch tables: "dense", "int4", ..."""
        return self.name.lower()

    @classmethod
    def of(cls, name: str) -> "Format":
        try:
            return cls[name.upper()]
        except KeyError:
            raise DecodeConfigError(f"format {name!r}; expected one of {[f.key for f in cls]}") from None


# Formats whose rows can be read as int32 words (the conversion-free decode), and those that can
# multiply int8 activations with dp4a.
WORD_FORMATS = (Format.INT8, Format.INT4, Format.INT4_ASYM, Format.TERNARY, Format.TERNARY2)
INT8_ACTIVATION_FORMATS = (Format.INT8, Format.INT4, Format.TERNARY2)


class DecodeMode(enum.IntEnum):
    """How the expert kernels decode packed int8/int4/ternary rows; the kernels' MODE constexpr.

    BYTES: byte loads and int-to-float conversions (the only path of dense rows).
    WORDS: int32 word loads decoded without conversions (a code c OR-ed into 0x4B000000 is the float
        2^23 + c), x loaded once per step and split in registers. ternary2 has no byte path: it runs
        WORDS whatever is asked below it. Base-3 ternary's word decode reads rows padded to whole
        words in the stacks (rows of no whole aligned words, e.g. the SSD tier's record buffers,
        run BYTES).
    INT8_ACTIVATIONS: x and h rounded to int8 per 64-column block, multiplied with dp4a (int8, int4
        and ternary2 rows; others run WORDS). Changes the numbers (kernels.quantize_activations is
        the reference), so it is opt-in."""

    BYTES = 0
    WORDS = 2
    INT8_ACTIVATIONS = 3


@dataclass(frozen=True)
class Launch:
    """Triton launch shape: BN output rows per program, BK input columns (packed formats: bytes) per
    loop step, num_warps, num_stages."""

    BN: int = 16
    BK: int = 256
    num_warps: int = 4
    num_stages: int = 3

    def kwargs(self) -> dict[str, int]:
        return asdict(self)


KERNELS = ("gate_up", "down", "gemv", "lm_head", "router", "norm")
VARIANTS = ("", "host", "a8")     # "host": groups in pinned host memory; "a8": INT8_ACTIVATIONS groups

# The shipped launch table, keyed (kernel, format, variant), from the H200 sweeps of
# benchmarks/decode_h200.py (expert and GEMV kernels; 8 disjoint experts per call, cold weights) and
# benchmarks/quant_kernels_h200.py (one quantized layer per format and decode mode). A host or a8
# group without its own entry uses its format's.
SHIPPED_LAUNCH: dict[tuple[str, str, str], Launch] = {
    ("gate_up", "dense", ""): Launch(4, 2048, 4, 2), ("down", "dense", ""): Launch(16, 256, 4, 3),
    ("gate_up", "int8", ""): Launch(8, 512, 4, 3), ("down", "int8", ""): Launch(16, 256, 4, 3),
    # int4's down: from the all-int4 plan's decode chain (decode_h200 chain_sweep_quant, an H100)
    ("gate_up", "int4", ""): Launch(8, 256, 4, 3), ("down", "int4", ""): Launch(16, 128, 4, 3),
    ("gate_up", "int4_asym", ""): Launch(8, 256, 4, 3), ("down", "int4_asym", ""): Launch(16, 256, 4, 3),
    # ternary is the cold format of the hot/cold plans: down tuned with one pair of a layer's eight,
    # gate_up in the decode chain of the hot int8 / cold ternary plan (decode_h200 chain_sweep; with
    # gate's and up's words decoded together, one 512-byte step covers a whole 412-byte row)
    ("gate_up", "ternary", ""): Launch(4, 512, 4, 3), ("down", "ternary", ""): Launch(8, 256, 4, 3),
    ("gate_up", "ternary", "host"): Launch(4, 512, 4, 3), ("down", "ternary", "host"): Launch(16, 256, 4, 3),
    # ternary2 with float x: int4's WORDS shapes (not swept); with int8 x, a whole 2048-column row
    # (512 bytes) per gate_up step
    ("gate_up", "ternary2", ""): Launch(8, 256, 4, 3), ("down", "ternary2", ""): Launch(16, 256, 4, 3),
    ("gate_up", "ternary2", "a8"): Launch(16, 512, 4, 2), ("down", "ternary2", "a8"): Launch(16, 256, 4, 2),
    # INT8_ACTIVATIONS (gate_up BN is 8 at least: one block of h per program)
    ("gate_up", "int4", "a8"): Launch(8, 1024, 4, 2), ("down", "int4", "a8"): Launch(16, 128, 4, 2),
    ("gate_up", "int8", "a8"): Launch(8, 2048, 4, 2),     # a whole row a step: chain_sweep_quant, an H100
    # the attention projections' GEMV ([q;k;v] and o_proj), swept over every layer's weights
    ("gemv", "dense", ""): Launch(2, 1024, 4, 4),
    # the same GEMV over the lm_head's [vocab x hidden] weight (MoETransformer.logits)
    ("lm_head", "dense", ""): Launch(2, 1024, 4, 4),
    # the fused router: num_warps 1 keeps the last program's softmax / top-k reductions in one warp;
    # two expert rows a program (64 arrivals a token at 128 experts) ran the quantized GPU plans
    # 1.0-1.5% faster than one, bf16 level (benchmarks/results/decode_ab_options.json, "router_bn2")
    ("router", "dense", ""): Launch(2, 2048, 1, 2),
    # the residual add + RMSNorm of one row (one program per row; only num_warps is used)
    ("norm", "dense", ""): Launch(1, 2048, 16, 1),
}
DEFAULT_LAUNCH = Launch()


@dataclass(frozen=True)
class AttentionLaunch:
    """decode_attention's launch: BLOCK_S cache slots per loop step (sm_90, D=128 bf16: 32 slots / 4
    warps use 192 registers and no spills, so two programs fit an SM). A context of at least
    split_from_slots (None: 2 * split_min_slots) gets enough KV splits for ~programs_per_sm programs
    per SM, none shorter than split_min_slots; a shorter one short_splits splits (at most one per
    block of slots). Up to last_split_merges splits are merged by the last split of each (query row,
    KV head) to finish, inside the attention launch; more by a combine launch.
    Splits of 128 slots from 1,024 on decoded bf16 and int4 12-15% faster at a 4,096-token context
    on the H200 than splits of 512 (4 KV heads x 8 splits left most SMs idle); 64 and 256 were
    slower (benchmarks/results/decode_ab_options.json, "attention_splits_*"). Four short splits
    merged in the launch, and splits of 128 from 512 on, decode 3.8-21.0% faster than one split
    below 1,024 at 128-640-token prompts on an H100, the same at 4,096
    ("attention_short_splits_h100"); merging in the launch pays for a few splits, the combine launch
    for eight and more."""

    block_s: int = 32
    num_warps: int = 4
    num_stages: int = 3
    split_min_slots: int = 128
    programs_per_sm: int = 2
    split_from_slots: int | None = 512
    short_splits: int = 4
    last_split_merges: int = 4

    def __post_init__(self) -> None:
        if self.split_min_slots < 1 or self.block_s < 16 or self.block_s & (self.block_s - 1):
            raise DecodeConfigError(f"attention: split_min_slots {self.split_min_slots} (>= 1), block_s "
                                    f"{self.block_s} (a power of two >= 16)")
        if self.short_splits < 1 or self.last_split_merges < 0:
            raise DecodeConfigError(f"attention: short_splits {self.short_splits} (>= 1), last_split_merges "
                                    f"{self.last_split_merges} (>= 0)")
        if self.split_from_slots is not None and self.split_from_slots < 1:
            raise DecodeConfigError(f"attention: split_from_slots {self.split_from_slots}; expected >= 1 or None")

    @property
    def first_split_slots(self) -> int:
        """The shortest context that gets more than one split."""
        return 2 * self.split_min_slots if self.split_from_slots is None else self.split_from_slots


EARLY_WEIGHT_KERNELS = ("router", "gemv", "down", "down_packed", "attention_kv")  # DecodeConfig.early_weights
DEFAULT_EARLY_WEIGHTS = ("router", "gemv", "down", "down_packed")
# DecodeConfig.early_launch. Not gate_up: down's early loads read the pair's expert before its own
# wait, which is safe only while gate_up's programs let down launch after the router has finished.
EARLY_LAUNCH_KERNELS = ("norm", "gemv", "rope", "attention", "router", "down")
MAX_EARLY_STEPS = 4
L2_PREFETCH_SITES = ("o_proj", "next_qkv")          # DecodeConfig.l2_prefetch
EXPERTS_IMPLS = ("auto", "gather", "loop", "grouped_mm", "triton")


@dataclass(frozen=True)
class DecodeConfig:
    """Every decode switch of one engine (frozen; derive variants with dataclasses.replace or
    `with_launch`).

    experts_impl: how the dense experts compute: "gather" copies the selected experts' weights and
        uses bmm (no host sync); "loop" groups tokens by expert (one host sync per layer);
        "grouped_mm" torch's grouped GEMM (bf16 on CUDA sm80+); "triton" the fused kernels (each
        selected expert read in place) up to fused_max_tokens tokens, else grouped_mm where it runs,
        else loop; "auto" gather up to gather_max_tokens tokens, else loop. Tiered experts: "triton"
        runs the fused kernels up to fused_max_tokens tokens and beyond them the grouped path (see
        tiered_stack_bytes) where torch's grouped GEMM runs, "grouped_mm" the grouped path in every
        step; otherwise, and where grouped GEMM does not run, one expert at a time.
    fused_ops: the fused non-expert decode ops (residual add + RMSNorm, [q;k;v] GEMM, q/k norm + RoPE
        + KV write, attention, routing) for steps up to fused_max_tokens tokens; None: on with "triton".
    gemv_max_tokens: steps of at most this many tokens run the attention projections through the
        Triton GEMV instead of cuBLAS; None: 1 on CUDA, 0 elsewhere (see `resolved`).
    decode_mode / mode_by_format: how packed rows are decoded (DecodeMode), per format overrides.
    int8_activations: the int8/int4/ternary2 groups of tiered experts run INT8_ACTIVATIONS.
    prefetch_host: tiered experts stage each layer's predicted host experts in HBM one layer early.
    prefetch_early: guess layer l+1's host experts from layer l's attention input (a longer copy
        window, an older guess) instead of its MoE input. Both off here: whether they pay depends on
        the device and the artifact, which the config does not know; the engine runner's "auto"
        turns both on with CUDA, experts_impl "triton" and host or ssd experts.
    ssd_lookahead: with prefetch_early, layers on the fused SSD path guess their experts from the
        attention input of each of the up to this many layers before them, and each guess starts
        the disk reads of the guessed records (a disk read takes longer than a layer); 1: only the
        layer before, like the host tier's prefetch.
    pdl: programmatic dependent launch (sm_90+): a kernel starts launching while its predecessor runs.
    overlap_host: the host-memory groups and the HBM groups of other formats than the largest
        group's run on side streams, concurrently with it.
    defer_moe_sum: the weighted expert sum is done by the next residual add + RMSNorm (no moe_sum launch).
    fused_norm_router: a MoE block without a shared expert is routed inside its post-attention
        norm's launch.
    fused_experts: a MoE call whose experts are one group (one format, one home: the all-bf16,
        all-int8 and all-int4 plans) runs gate_up and down as one launch (moe_kernels.expert_ffn_kernel):
        each pair's down programs start on that pair's h as soon as its gate_up blocks are in, instead
        of after the whole gate_up launch. The same sums, bit for bit. Off: 3.0-7.6% slower on an H100
        (docs/engine-speed.md).
    rope_in_attention: one-token steps do q/k norm, RoPE and the KV write inside the decode
        attention launch (kernels.RopeInputs), which reads the RoPE tables at the positions itself:
        one launch per layer fewer. Off: slower on an H100 at 24 layers (bf16 2.7%, int8 and int4
        with int8 activations 4.8% and 3.9% at a 128-token prompt; 6.4-8.3% at 4,096:
        benchmarks/results/decode_ab_options.json, "rope_in_attention_tables_h100"); likely, not
        measured, because every split program of a KV head redoes its q heads' norm and RoPE.
    early_weights: kernels, of EARLY_WEIGHT_KERNELS, whose programs load their first weight tiles
        before the PDL wait, so their DRAM latency overlaps the kernel before them: "router" (the
        fused norm + router's weight rows), "gemv" (the attention projections' first early_steps K
        steps), "down" (bf16 experts' first early_steps K steps: the pair's expert comes from the
        router, two launches back), "down_packed" (the same for experts whose down rows are read
        as int32 words: int8, int4, int4_asym, ternary2, with float or int8 activations),
        "attention_kv" (one-token steps: the decode attention's first block of cache slots before
        the row's position, which earlier steps wrote). Weights and old cache slots never change
        during a step, so this reads nothing the wait protects; the sums are the same, bit for bit.
        Default DEFAULT_EARLY_WEIGHTS (all but "attention_kv", which measured 1-2% slower on an
        H100), with early_steps 2 and early_launch all (see there). "down_packed" decoded the
        all-int8 plan 1.1% faster, int4 2.4%, int8 with int8 x 2.7%, int4 with int8 x 4.5% (an H100,
        24 layers of the 30B shape: benchmarks/results/decode_ab_options.json,
        "early_weights_down_packed"), the same tokens.
    early_steps: how many K steps of weights the "gemv" and "down" early loads cover (1 to
        MAX_EARLY_STEPS, never more than the kernel has): more bytes in flight before the wait.
    early_launch: kernels, of EARLY_LAUNCH_KERNELS, that let the next kernel start launching before
        their own PDL wait instead of after it (runtime.grid_dependency's LAUNCH_FIRST): a kernel
        whose programs all fit on the GPU at once then has its successor resident, loading its
        early weights, while it waits and runs, a whole launch earlier than otherwise. The default
        (all of them, early_weights router, gemv and down, early_steps 2) measured on the H200 against
        early_weights router + down alone: bf16 +1.2%, int4 +2.4%, the int8 / ternary2 a8 plan
        +0.7% (two H200 calls alike). early_steps 4 made bf16 1.5% slower.
    lm_head_gemv: decode steps (up to gemv_tokens rows) compute the logits with the Triton GEMV,
        stored as float32 by the kernel (MoETransformer.logits), instead of cuBLAS and a cast launch.
    router_max_tokens: most tokens one fused router call takes (size of its arrival counters and mailboxes).
    router_poll: the fused norm + router's last program per token polls a mailbox of the logits'
        bits for the top-k instead of an arrival counter deciding which program runs it
        (norm_router.add_rmsnorm_router_kernel's POLL): no acq_rel atomic per program. The same
        results. Calls of fewer tokens than the GPU has SMs poll; larger ones use the counter. On
        the H200 against the counter: bf16 +1.5%, int4 +1.8%, int8 hot / base-3 cold +1.4%, same
        tokens (benchmarks/results/decode_ab_options.json, "router_poll").
    count_tier_picks: tiered experts on the fused path count each call's picks per expert on the
        device, one atomic per (token, expert) pair inside fused_moe's down launch (and stage copies
        inside prefetch's map launch), so their telemetry covers CUDA-graph replays at no extra launch.
    l2_prefetch: dense weights, of L2_PREFETCH_SITES, that a latency-bound launch asks the L2 cache
        for while the memory bus would idle (runtime.prefetch_l2: `prefetch.global.L2::evict_last`,
        nothing waits for it), so the GEMV that reads them later hits L2: "o_proj" (the layer's
        output projection, from extra programs of the q/k norm + RoPE launch, before the attention),
        "next_qkv" (the next layer's [q; k; v] matrix, from extra programs of the fused norm +
        router, before the experts). Extra programs only: the sums are the same, bit for bit. On
        CUDA only (the CPU interpreter has no inline PTX: there the extra programs run without the
        prefetch instruction). Off by default: on the H200 every site and program count measured
        slower than without (docs/engine-speed.md).
    l2_prefetch_programs: how many extra programs a prefetch site launches (each asks for an equal
        share of the weight's 128-byte lines).
    experts_evict_first: the fused experts' dense rows (and int8 rows in DecodeMode.BYTES) in GPU
        memory are loaded with L2's evict_first policy: each is read once a step, so they leave L2
        before lines that are read again (the dense weights, the KV cache). The same sums. On by
        default: bf16 decodes about 2% faster on the H200 (docs/engine-speed.md).
    packed_evict_first: the same hint for the other packed rows in GPU memory (int8, int4, ternary2
        and base-3 words, with float or int8 activations; int4 and ternary bytes). The same sums.
    tiered_stack_bytes: tiered experts' steps beyond the fused path (prefill, larger batches) with
        experts_impl "grouped_mm", or "triton" where torch's grouped GEMM runs (bf16 on CUDA),
        dequantize the picked experts into stacks and run them as three grouped GEMMs: this is the
        most bytes of dequantized gate, up and down one stack holds (a layer's experts are split
        by id into ranges of as many as fit, at least one). A layer whose experts are all in GPU
        memory and fit one stack runs without the routing on the host. Dequantizing takes
        temporaries on top: a byte or two a weight for the codes, four for int4_asym's and the
        low-rank formats' float32 weights.
    """

    experts_impl: str = "auto"
    fused_ops: bool | None = None
    gemv_max_tokens: int | None = None
    gather_max_tokens: int = 4
    fused_max_tokens: int = 16
    decode_mode: DecodeMode = DecodeMode.WORDS
    mode_by_format: Mapping[str, DecodeMode] = field(default_factory=dict)
    int8_activations: bool = False
    prefetch_host: bool = False
    prefetch_early: bool = False
    ssd_lookahead: int = 1
    pdl: bool = True
    overlap_host: bool = True
    defer_moe_sum: bool = True
    fused_norm_router: bool = True
    fused_experts: bool = False
    rope_in_attention: bool = False
    early_weights: tuple[str, ...] = DEFAULT_EARLY_WEIGHTS
    early_steps: int = 2
    early_launch: tuple[str, ...] = EARLY_LAUNCH_KERNELS
    lm_head_gemv: bool = True
    router_max_tokens: int = 64
    router_poll: bool = True
    count_tier_picks: bool = True
    l2_prefetch: tuple[str, ...] = ()
    l2_prefetch_programs: int = 32
    experts_evict_first: bool = True
    packed_evict_first: bool = False
    tiered_stack_bytes: int = 1 << 30
    launch: Mapping[tuple[str, str, str], Launch] = field(default_factory=lambda: dict(SHIPPED_LAUNCH))
    attention: AttentionLaunch = AttentionLaunch()

    def __post_init__(self) -> None:
        if self.experts_impl not in EXPERTS_IMPLS:
            raise DecodeConfigError(f"experts_impl {self.experts_impl!r}: expected one of {', '.join(EXPERTS_IMPLS)}")
        for key in ("prefetch_host", "int8_activations"):
            if getattr(self, key) and self.experts_impl != "triton":
                raise DecodeConfigError(f"{key} needs experts_impl 'triton' (the fused kernels), "
                                        f"not {self.experts_impl!r}")
        if self.prefetch_early and not self.prefetch_host:
            raise DecodeConfigError("prefetch_early needs prefetch_host (it moves where the prefetch guesses from)")
        early = tuple(self.early_weights)
        if set(early) - set(EARLY_WEIGHT_KERNELS):
            raise DecodeConfigError(f"early_weights {list(early)}: expected kernels of {list(EARLY_WEIGHT_KERNELS)}")
        object.__setattr__(self, "early_weights", tuple(k for k in EARLY_WEIGHT_KERNELS if k in early))
        if not 1 <= self.early_steps <= MAX_EARLY_STEPS:
            raise DecodeConfigError(f"early_steps must be 1 to {MAX_EARLY_STEPS}, got {self.early_steps}")
        first = tuple(self.early_launch)
        if set(first) - set(EARLY_LAUNCH_KERNELS):
            raise DecodeConfigError(f"early_launch {list(first)}: expected kernels of {list(EARLY_LAUNCH_KERNELS)}")
        object.__setattr__(self, "early_launch", tuple(k for k in EARLY_LAUNCH_KERNELS if k in first))
        sites = tuple(self.l2_prefetch)
        if set(sites) - set(L2_PREFETCH_SITES):
            raise DecodeConfigError(f"l2_prefetch {list(sites)}: expected sites of {list(L2_PREFETCH_SITES)}")
        object.__setattr__(self, "l2_prefetch", tuple(k for k in L2_PREFETCH_SITES if k in sites))
        if not 1 <= self.l2_prefetch_programs <= 1024:
            raise DecodeConfigError(f"l2_prefetch_programs must be 1 to 1024, got {self.l2_prefetch_programs}")
        if self.tiered_stack_bytes < 1:
            raise DecodeConfigError(f"tiered_stack_bytes must be >= 1, got {self.tiered_stack_bytes}")
        if self.ssd_lookahead < 1:
            raise DecodeConfigError(f"ssd_lookahead must be >= 1, got {self.ssd_lookahead}")
        for name in ("gather_max_tokens", "fused_max_tokens", "router_max_tokens"):
            if getattr(self, name) < 0:
                raise DecodeConfigError(f"{name} must be >= 0, got {getattr(self, name)}")
        if isinstance(self.attention, Mapping):      # JSON options: {"attention": {"block_s": 64}}
            try:
                object.__setattr__(self, "attention", AttentionLaunch(**self.attention))
            except TypeError as e:
                raise DecodeConfigError(f"attention {dict(self.attention)}: expected fields of "
                                        f"{list(AttentionLaunch.__dataclass_fields__)} ({e})") from None
        modes = {}
        for fmt, mode in dict(self.mode_by_format).items():
            modes[Format.of(fmt).key] = DecodeMode(mode)
        # read-only views: the config stays what it was built as
        object.__setattr__(self, "decode_mode", DecodeMode(self.decode_mode))
        object.__setattr__(self, "mode_by_format", MappingProxyType(modes))
        object.__setattr__(self, "launch", MappingProxyType(dict(self.launch)))

    # ---- derived settings -------------------------------------------------------------------------
    @property
    def fused_decode(self) -> bool:
        """Whether the fused non-expert decode ops run (fused_ops, or None and experts_impl triton)."""
        return self.experts_impl == "triton" if self.fused_ops is None else bool(self.fused_ops)

    @property
    def fused_tokens(self) -> int:
        """Steps of up to this many tokens (B * T) run the fused decode ops (0: none)."""
        return self.fused_max_tokens if self.fused_decode else 0

    @property
    def gemv_tokens(self) -> int:
        """Steps of up to this many tokens run the attention projections through the Triton GEMV."""
        return min(self.gemv_max_tokens or 0, self.fused_tokens)

    @property
    def is_resolved(self) -> bool:
        """Whether the device-dependent defaults are filled in (fused_ops and gemv_max_tokens set):
        `resolved` would return the config unchanged."""
        return self.fused_ops is not None and self.gemv_max_tokens is not None

    def resolved(self, device_type: str) -> "DecodeConfig":
        """The config with its device-dependent defaults filled in (fused_ops, gemv_max_tokens)."""
        gemv = self.gemv_max_tokens
        if gemv is None:
            gemv = 1 if device_type == "cuda" and self.fused_decode else 0
        return replace(self, fused_ops=self.fused_decode, gemv_max_tokens=gemv)

    def mode_of(self, fmt: str) -> DecodeMode:
        """The decode mode asked for `fmt` (before a group's own constraints)."""
        mode = self.mode_by_format.get(fmt, self.decode_mode)
        # ternary2 has no byte path: float x runs its word decode whatever is asked below it
        return max(mode, DecodeMode.WORDS) if fmt == "ternary2" else mode

    @cached_property
    def _launch_cache(self) -> dict:
        return {}

    def launch_for(self, kernel: str, fmt: str, host: bool = False, a8: bool = False) -> Launch:
        """The launch shape of `kernel` on weights of format `fmt` (host: a group in pinned host
        memory; a8: a group in INT8_ACTIVATIONS), falling back to the format's plain entry."""
        key = (kernel, fmt, host, a8)
        hit = self._launch_cache.get(key)
        if hit is None:
            hit = ((self.launch.get((kernel, fmt, "host")) if host else None)
                   or (self.launch.get((kernel, fmt, "a8")) if a8 else None)
                   or self.launch.get((kernel, fmt, "")) or DEFAULT_LAUNCH)
            self._launch_cache[key] = hit
        return hit

    def with_launch(self, kernel: str, fmt: str, host: bool = False, a8: bool = False, **params: int
                    ) -> "DecodeConfig":
        """A copy whose launch entry for (kernel, fmt, host / a8) has `params` changed."""
        if kernel not in KERNELS:
            raise DecodeConfigError(f"with_launch: kernel {kernel!r}; expected one of {KERNELS}")
        Format.of(fmt)
        bad = set(params) - set(Launch.__dataclass_fields__)
        if bad:
            raise DecodeConfigError(f"with_launch: unknown parameters {sorted(bad)}; expected "
                                    f"{list(Launch.__dataclass_fields__)}")
        variant = "host" if host else "a8" if a8 else ""
        new = replace(self.launch_for(kernel, fmt, host, a8), **params)
        per_byte = {"int4": 2, "int4_asym": 2, "ternary2": 4}.get(fmt)
        if per_byte and kernel in ("gate_up", "down") and new.BK % (GROUP // per_byte):
            # steps cover whole 64-column groups (int4: 32 bytes, ternary2: 16) so each group's scale is loaded once
            raise DecodeConfigError(f"with_launch: {kernel}/{fmt} BK={new.BK} bytes; expected a multiple of "
                                    f"{GROUP // per_byte}")
        if fmt == "ternary" and kernel in ("gate_up", "down") and new.BK % 4:
            # base-3's word decode steps over whole int32 words
            raise DecodeConfigError(f"with_launch: {kernel}/ternary BK={new.BK} bytes; expected a multiple of 4")
        return replace(self, launch={**self.launch, (kernel, fmt, variant): new})

    def with_launches(self, params: Mapping[str, Any], kernels=("gate_up", "down"), formats=None) -> "DecodeConfig":
        """A copy with `params` set for every (kernel, format) given (formats: all by default)."""
        cfg = self
        for kernel in kernels:
            for fmt in formats or [f.key for f in Format]:
                cfg = cfg.with_launch(kernel, fmt, **params)
        return cfg

    def identity(self) -> dict[str, Any]:
        """A JSON-able record of every setting (what a run manifest's build identity carries)."""
        out: dict[str, Any] = {}
        for name in self.__dataclass_fields__:
            v = getattr(self, name)
            if name == "launch":
                v = {"/".join(p for p in key if p): asdict(val) for key, val in sorted(v.items())}
            elif name == "mode_by_format":
                v = {k: m.name for k, m in sorted(v.items())}
            elif name == "decode_mode":
                v = v.name
            elif name == "attention":
                v = asdict(v)
            out[name] = v
        return out


DEFAULT = DecodeConfig()
