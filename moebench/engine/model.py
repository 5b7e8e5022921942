"""The MoE decoder: RMSNorm, RoPE, GQA attention over a static KV cache, stacked SwiGLU experts.

Module and parameter names follow the Hugging Face checkpoints (minus the leading `model.`), so the
loader maps tensors by name: `embed_tokens`, `layers.{i}.self_attn.q_proj`, `layers.{i}.mlp.gate`,
`layers.{i}.mlp.experts` (an `Experts`: stacked [E, ...] weights), `norm`, `lm_head`.

Sequences live in fixed KV-cache rows: row b's token at position p is written to slot p, and a query
at position p attends to slots 0..p of its own row. Prompts of different lengths are therefore
right-padded: padding sits after the real tokens, is never visible to them, and is overwritten by
the row's own generated tokens before any query could see it. Positions are exact per row, so a
batched row computes what the same prompt alone would.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from .config import ModelConfig
from .decode_config import DEFAULT, DecodeConfig
from .experts_protocol import ExpertsModule
from .quant import GROUP


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32, scale in the activation dtype (as transformers does).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_tables(head_dim: int, theta: float, max_len: int, device=None) -> tuple[Tensor, Tensor]:
    """cos/sin [max_len, head_dim] in float32 for the default (unscaled) rotary embedding."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float, device=device) / head_dim))
    freqs = torch.arange(max_len, device=device, dtype=torch.float)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, D]; cos/sin [B, T, D] already in x's dtype."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm == "head":      # qwen3: per head, over head_dim
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":    # olmoe: over the whole projected q / k width
            self.q_norm = RMSNorm(cfg.num_heads * d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.num_kv_heads * d, cfg.rms_norm_eps)
        self.clip_qkv = cfg.clip_qkv
        self.eps = cfg.rms_norm_eps
        self.decode: DecodeConfig = DEFAULT  # see configure
        self.qkv_weight: Tensor | None = None   # [q; k; v] rows, set by fuse_qkv (one GEMM in decode)
        self.qkv_bias: Tensor | None = None
        self.k_cache: Tensor | None = None   # [B, kv_heads, max_len, head_dim]
        self.v_cache: Tensor | None = None

    def configure(self, cfg: DecodeConfig) -> None:
        """Decode with `cfg`; fused decode steps (cfg.fused_tokens) read the [q; k; v] matrix."""
        self.decode = cfg
        if cfg.fused_tokens:
            self.fuse_qkv()

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """Concatenate the q/k/v projection weights (and biases) into one [q; k; v] matrix and make
        the three parameters views into it: same parameters and state_dict, no extra memory, and
        decode runs one GEMM instead of three. Skipped when the three differ in dtype or device."""
        ws = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        if self.qkv_weight is not None or len({(w.dtype, w.device) for w in ws}) != 1 or ws[0].is_meta:
            return
        fused = torch.cat([w.detach() for w in ws])
        nq, nk = ws[0].shape[0], ws[1].shape[0]
        for proj, view in zip((self.q_proj, self.k_proj, self.v_proj), fused.split([nq, nk, nk])):
            proj.weight.data = view
        self.qkv_weight = fused
        if self.q_proj.bias is not None:
            bias = torch.cat([self.q_proj.bias.detach(), self.k_proj.bias.detach(), self.v_proj.bias.detach()])
            for proj, view in zip((self.q_proj, self.k_proj, self.v_proj), bias.split([nq, nk, nk])):
                proj.bias.data = view
            self.qkv_bias = bias

    def _linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if x.numel() // x.shape[-1] <= self.decode.gemv_tokens:
            from . import kernels       # Triton is imported only where the fused paths run
            return kernels.linear(x, weight, bias, cfg=self.decode)
        return F.linear(x, weight, bias)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, kv_len: int,
                causal_tail: bool = False) -> Tensor:
        """x [B, T, H]; positions [B, T] (cache slot = position); attend to slots [0, kv_len).
        cos / sin: this step's RoPE rows [B, T, D] in x's dtype, or, on the fused path, the float32
        tables [S, D] (qk_rope_cache reads the rows itself). causal_tail: every row's positions are
        kv_len - T .. kv_len - 1 (a prefill chunk), so the mask is the lower-right causal one."""
        B, T, _ = x.shape
        fused = B * T <= self.decode.fused_tokens
        if fused and self.qkv_weight is not None:
            nq, nk = self.n_heads * self.head_dim, self.n_kv * self.head_dim
            q, k, v = self._linear(x, self.qkv_weight, self.qkv_bias).split([nq, nk, nk], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(B, T, self.n_heads, self.head_dim)
        k = k.view(B, T, self.n_kv, self.head_dim)
        v = v.view(B, T, self.n_kv, self.head_dim)
        if fused:
            from . import kernels
            head = self.qk_norm == "head"
            # Triton's CPU interpreter gets bf16 dots wrong, so bf16 on CPU keeps sdpa.
            attention_kernel = self.k_cache.dtype == q.dtype and (q.is_cuda or q.dtype != torch.bfloat16)
            qw, kw = (self.q_norm.weight, self.k_norm.weight) if head else (None, None)
            rope = None
            if attention_kernel and T == 1 and self.decode.rope_in_attention:
                # q/k norm, RoPE and the cache writes inside the attention launch (which reads the
                # tables of MoETransformer._fused_layers at the positions itself)
                rope = kernels.RopeInputs(k, v, qw, kw, self.eps, cos, sin)
            else:
                # One kernel: per-head q/k norm, RoPE, and the cache writes (kernels.qk_rope_cache).
                q = kernels.qk_rope_cache(q, k, v, qw, kw, self.eps, cos, sin, positions, self.k_cache,
                                          self.v_cache, cfg=self.decode,
                                          prefetch=self.o_proj.weight if attention_kernel else None)
            # One kernel for mask + attention + the [B, T, heads * D] layout o_proj reads (~5 in torch).
            if attention_kernel:
                out = kernels.decode_attention(q, self.k_cache, self.v_cache, positions.expand(B, T), kv_len,
                                               cfg=self.decode, rope=rope)
                return self._linear(out, self.o_proj.weight, self.o_proj.bias)
        else:
            if self.qk_norm == "head":
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

            # Write this step's keys/values into each row's slots (static shapes; no host sync).
            rows = torch.arange(B, device=x.device)[:, None].expand(B, T)
            self.k_cache[rows, :, positions] = k.transpose(1, 2).to(self.k_cache.dtype)
            self.v_cache[rows, :, positions] = v.transpose(1, 2).to(self.v_cache.dtype)
        keys, values = self.k_cache[:B, :, :kv_len], self.v_cache[:B, :, :kv_len]
        gqa = self.n_heads != self.n_kv
        if causal_tail:
            out = _tail_causal_attention(q, keys, values, gqa)
        else:
            slots = torch.arange(kv_len, device=x.device)
            mask = (slots[None, None, :] <= positions[:, :, None]).unsqueeze(1)   # [B, 1, T, kv_len]
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=gqa)
        out = out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)
        return self._linear(out, self.o_proj.weight, self.o_proj.bias)


def _tail_causal_attention(q: Tensor, keys: Tensor, values: Tensor, gqa: bool) -> Tensor:
    """Attention of a chunk's T queries, the last T of the kv_len slots, with the lower-right causal
    mask and no mask tensor: flash attention takes it as is. With an explicit mask torch picks
    cuDNN, which builds an execution graph for each new (T, kv_len), up to a second on a fresh
    machine (docs/engine-speed.md, "A new prompt length's first request"); flash builds none."""
    T, kv_len = q.shape[-2], keys.shape[-2]
    bias = causal_lower_right(T, kv_len) if T != kv_len else None
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=bias, is_causal=bias is None,
                                              enable_gqa=gqa)


class DenseMLP(nn.Module):
    """SwiGLU MLP: down(silu(gate x) * up x). Used for qwen2's shared expert and dense layers."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """All experts of one layer, resident, one dtype, stacked.

    w_gate: [E, I, H], w_up: [E, I, H], w_down: [E, H, I]. The swap point for tiered experts: a
    replacement keeps `forward(x, topk_ids, topk_w)`.
    """

    # How forward computes is the engine's DecodeConfig.experts_impl (see its docstring), given by
    # configure(); a module built alone runs DEFAULT ("auto").

    def __init__(self, num_experts: int, hidden: int, intermediate: int):
        super().__init__()
        self.num_experts = num_experts
        self.w_gate = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_up = nn.Parameter(torch.empty(num_experts, intermediate, hidden))
        self.w_down = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.decode: DecodeConfig = DEFAULT

    # ---- the ExpertsModule protocol (experts_protocol.py) ----
    def configure(self, cfg: DecodeConfig, top_k: int) -> None:
        self.decode = cfg

    def sync_free_tokens(self) -> int:
        """Up to how many tokens forward runs without host syncs (CUDA-graph capturable)."""
        impl = self.decode.experts_impl
        if impl == "triton":
            return 1 << 30 if self._grouped_mm_runs() else self.decode.fused_max_tokens
        return {"grouped_mm": 1 << 30, "loop": 0}.get(impl, self.decode.gather_max_tokens)

    def segment_tokens(self) -> int:
        """Up to how many tokens a segmented capture holds this module (no host syncs: as many as
        sync_free_tokens)."""
        return self.sync_free_tokens()

    def segment_with(self, segments) -> None:
        pass                     # no host syncs to cut at

    def partials_ok(self, tokens: int) -> bool:
        """Whether forward_partials runs for this many tokens (the fused Triton path)."""
        return self.decode.experts_impl == "triton" and tokens <= self.decode.fused_max_tokens

    def wants_quantized_x(self) -> bool:
        return False            # dense weights: float activations only

    @property
    def prefetching(self) -> bool:
        return False            # every expert is resident

    def prefetch(self, h: Tensor, gate_weight: Tensor, top_k: int, renormalize: bool, own_stream: bool = False,
                 ahead: int = 1) -> None:
        pass

    def forward_partials(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor, xq: Tensor | None = None) -> Tensor:
        """The float32 weighted terms [T * k, H] whose per-token sums forward returns (see
        kernels.fused_moe(reduce=False)); only where partials_ok. xq: unused (float activations)."""
        from . import kernels
        return kernels.fused_moe(x, topk_ids, topk_w, [kernels.dense_group(self.w_gate, self.w_up, self.w_down)],
                                 cfg=self.decode, reduce=False)

    def _grouped_mm_runs(self) -> bool:
        return self.w_gate.is_cuda and self.w_gate.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")

    def forward(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor) -> Tensor:
        """x [T, H]; topk_ids [T, k] int64; topk_w [T, k] float -> [T, H] (weighted sum)."""
        T = topk_ids.shape[0]
        impl = self.decode.experts_impl
        if impl == "auto":
            impl = "gather" if T <= self.decode.gather_max_tokens else "loop"
        if impl == "triton":
            if T <= self.decode.fused_max_tokens:
                from . import kernels   # Triton is imported only when this path runs
                return kernels.fused_moe(x, topk_ids, topk_w,
                                         [kernels.dense_group(self.w_gate, self.w_up, self.w_down)], cfg=self.decode)
            impl = "grouped_mm" if self._grouped_mm_runs() else "loop"
        if impl == "gather":
            return self._gather(x, topk_ids, topk_w)
        if impl == "grouped_mm":
            return self._grouped_mm(x, topk_ids, topk_w)
        if impl == "loop":
            return self._loop(x, topk_ids, topk_w)
        raise ValueError(f"experts_impl {impl!r}: expected auto, gather, loop, grouped_mm or triton")

    def _gather(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor) -> Tensor:
        T, k = topk_ids.shape
        ids = topk_ids.reshape(-1)
        xs = x.unsqueeze(1).expand(T, k, x.shape[-1]).reshape(T * k, -1, 1)   # [T*k, H, 1]
        h = F.silu(torch.bmm(self.w_gate[ids], xs)) * torch.bmm(self.w_up[ids], xs)
        return self._weighted_sum(torch.bmm(self.w_down[ids], h).squeeze(-1), topk_w)   # y: [T*k, H]

    def _loop(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor) -> Tensor:
        T, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()   # one sync per layer
        xs = x[order // k]
        y = torch.empty(T * k, x.shape[-1], dtype=x.dtype, device=x.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            xe = xs[start:start + n]
            h = F.silu(xe @ self.w_gate[e].t()) * (xe @ self.w_up[e].t())
            y[order[start:start + n]] = h @ self.w_down[e].t()
            start += n
        return self._weighted_sum(y, topk_w)

    @staticmethod
    def _weighted_sum(y: Tensor, topk_w: Tensor) -> Tensor:
        """sum_j topk_w[t, j] * y[t * k + j] in the order j = 0..k-1, in float32: y holds each (token,
        expert) pair's output in pair order. A fixed order, as _gather and the fused kernels sum:
        index_add_ on CUDA adds with atomics, so its sums (and a near-tie's greedy token) changed from
        run to run."""
        T, k = topk_w.shape
        return (y.view(T, k, -1).float() * topk_w.float().unsqueeze(-1)).sum(1).to(y.dtype)

    def _grouped_mm(self, x: Tensor, topk_ids: Tensor, topk_w: Tensor) -> Tensor:
        T, k = topk_ids.shape
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # Group ends per expert, computed on the device (histc, not bincount: graph-capturable).
        counts = torch.histc(flat.float() if x.device.type == "cpu" else flat.int(),
                             bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        xs = x[order // k].to(self.w_gate.dtype)
        gate = F.grouped_mm(xs, self.w_gate.transpose(1, 2), offs=offs)
        up = F.grouped_mm(xs, self.w_up.transpose(1, 2), offs=offs)
        y = torch.empty(T * k, x.shape[-1], dtype=x.dtype, device=x.device)
        y[order] = F.grouped_mm(F.silu(gate) * up, self.w_down.transpose(1, 2), offs=offs).to(x.dtype)
        return self._weighted_sum(y, topk_w)


class RouterTracer:
    """Collects router decisions while attached to a model (see `MoETransformer.set_tracer`).

    records: (decoder layer index, topk_ids [T, k] int64, topk_w [T, k] float32), CPU tensors, in
    call order. logits: (layer, router logits [T, E] float32) when `keep_logits` is set.
    """

    def __init__(self, keep_logits: bool = False):
        self.keep_logits = keep_logits
        self.records: list[tuple[int, Tensor, Tensor]] = []
        self.logits: list[tuple[int, Tensor]] = []


class MoEBlock(nn.Module):
    """Router -> softmax -> top-k (-> renormalise) -> experts (+ gated shared expert, qwen2_moe)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.top_k = cfg.top_k
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts: ExpertsModule = Experts(cfg.num_experts, cfg.hidden_size, cfg.expert_intermediate_size)
        self.shared_expert = None
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False)
        self.tracer: RouterTracer | None = None
        self.decode: DecodeConfig = DEFAULT  # see configure

    def configure(self, cfg: DecodeConfig) -> None:
        """Decode with `cfg`, this block and its experts module (ExpertsModule.configure)."""
        self.decode = cfg
        self.experts.configure(cfg, self.top_k)

    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [N, H] -> (router logits [N, E], topk_ids [N, k], topk_w [N, k] float32)."""
        if x.shape[0] <= self.decode.fused_tokens:
            from . import kernels      # router GEMV + softmax + top-k + renormalise in one launch, no sort
            return kernels.router_topk(x, self.gate.weight, self.top_k, self.norm_topk_prob, cfg=self.decode)
        logits = self.gate(x)
        probs = torch.softmax(logits.float(), dim=-1)
        topk_w, topk_ids = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            topk_w = topk_w / topk_w.sum(dim=-1, keepdim=True)
        return logits, topk_ids, topk_w

    def norm_router_ok(self, tokens: int) -> bool:
        """Whether the fused decode layers may route this block's `tokens` tokens inside the
        post-attention norm (kernels.add_rmsnorm_router, one launch) and pass the routes in: where
        route() itself would use router_topk (the fused kernel gives its bits), in blocks without a
        shared expert (the qwen3/olmoe-style decode path this fusion was made for)."""
        cfg = self.decode
        return (self.shared_expert is None and cfg.fused_norm_router
                and tokens <= min(cfg.router_max_tokens, cfg.fused_tokens))

    def _route_traced(self, x: Tensor, routes: tuple[Tensor, Tensor, Tensor] | None = None
                      ) -> tuple[Tensor, Tensor]:
        """route(x), or the given routes (logits, topk_ids, topk_w) for x's tokens, recorded in the
        tracer either way."""
        logits, topk_ids, topk_w = self.route(x) if routes is None else routes
        if self.tracer is not None:
            self.tracer.records.append((self.layer_idx, topk_ids.cpu(), topk_w.cpu()))
            if self.tracer.keep_logits:
                self.tracer.logits.append((self.layer_idx, logits.float().cpu()))
        return topk_ids, topk_w

    def forward_partials(self, x: Tensor, routes: tuple[Tensor, Tensor, Tensor] | None = None,
                         xq: Tensor | None = None) -> Tensor | None:
        """The experts' float32 terms [N * top_k, H] (N = tokens of x) for the caller to sum (the
        fused decode layers do it inside the next add_rmsnorm), or None where this block cannot
        (a shared expert, or experts without a fused partials path for this many tokens).
        routes: (logits [N, E], topk_ids [N, k], topk_w [N, k]) already computed for x's flattened
        tokens (kernels.add_rmsnorm_router), used instead of routing here. xq: x's int8 rows for
        experts that want them (wants_quantized_x), from the same launch."""
        flat = x.reshape(-1, x.shape[-1])
        if self.shared_expert is not None or not self.experts.partials_ok(flat.shape[0]):
            return None
        topk_ids, topk_w = self._route_traced(flat, routes)
        return self.experts.forward_partials(flat, topk_ids, topk_w, xq=xq)

    def forward(self, x: Tensor, routes: tuple[Tensor, Tensor, Tensor] | None = None) -> Tensor:
        """x [..., H] -> [..., H]; routes as in forward_partials (None: route here)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        topk_ids, topk_w = self._route_traced(x, routes)
        out = self.experts(x, topk_ids, topk_w)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out.view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe_layers[layer_idx]:
            self.mlp: nn.Module = MoEBlock(cfg, layer_idx)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, kv_len: int,
                causal_tail: bool = False) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, kv_len, causal_tail)
        return x + self.mlp(self.post_attention_layernorm(x))


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.max_batch = 0
        self.max_seq_len = 0
        self.decode: DecodeConfig = DEFAULT      # see configure
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)

    def gemv_logits(self, rows: int) -> bool:
        """Whether a decode step of `rows` rows computes its logits with the Triton GEMV (logits)."""
        return self.decode.lm_head_gemv and rows <= self.decode.gemv_tokens

    def logits(self, h: Tensor, decode: bool = False, pick_keys: Tensor | None = None) -> Tensor:
        """lm_head(h).float(): float32 logits [..., V] whose values are rounded to h's dtype. A
        decode step's (decode, gemv_logits) runs the Triton GEMV, which stores them as float32
        itself (no cast launch) and starts under PDL like the other decode kernels (cuBLAS' GEMM
        launches after the final norm has finished); its sums run in another order than cuBLAS',
        so prefill and scoring keep cuBLAS. pick_keys (GEMV only): the GEMV also folds each row's
        greedy pick into them (kernels.greedy_pick)."""
        if decode and self.gemv_logits(h.numel() // h.shape[-1]):
            from . import kernels
            return kernels.linear(h, self.lm_head.weight, self.lm_head.bias, cfg=self.decode,
                                  out_dtype=torch.float32, pick_keys=pick_keys, shape="lm_head")
        if pick_keys is not None:
            raise ValueError("logits: pick_keys needs a decode step on the lm_head GEMV (gemv_logits)")
        return self.lm_head(h).float()

    def moe_blocks(self) -> list[MoEBlock]:
        return [layer.mlp for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def setup_caches(self, max_batch: int, max_seq_len: int, dtype: torch.dtype, device) -> None:
        """Allocate the static KV cache and RoPE tables (replacing any earlier ones)."""
        cfg = self.config
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        for layer in self.layers:
            attn = layer.self_attn
            shape = (max_batch, cfg.num_kv_heads, max_seq_len, cfg.head_dim)
            attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
            attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.rope_cos, self.rope_sin = rope_tables(cfg.head_dim, cfg.rope_theta, max_seq_len, device)

    def configure(self, cfg: DecodeConfig) -> None:
        """Decode with `cfg` (a resolved DecodeConfig): every attention, MoE block and experts module
        gets it. Steps of at most cfg.fused_tokens tokens (B * T; decode) run the fused Triton ops:
        residual add + RMSNorm, one [q; k; v] GEMM (Attention.fuse_qkv), q/k norm + RoPE + KV-cache
        write, attention, routing; larger steps (prefill) keep the torch ops."""
        self.decode = cfg
        for layer in self.layers:
            layer.self_attn.configure(cfg)
            if isinstance(layer.mlp, MoEBlock):
                layer.mlp.configure(cfg)

    def set_tracer(self, tracer: RouterTracer | None) -> None:
        for block in self.moe_blocks():
            block.tracer = tracer

    def forward(self, tokens: Tensor, positions: Tensor, kv_len: int, causal_tail: bool = False) -> Tensor:
        """tokens, positions [B, T] -> final-normed hidden states [B, T, H] (apply `lm_head` to
        the positions whose logits you need). Attends to cache slots [0, kv_len). causal_tail: the
        caller promises every row's positions are kv_len - T .. kv_len - 1 (a prefill chunk)."""
        if tokens.numel() <= self.decode.fused_tokens:
            return self._fused_layers(tokens, positions, kv_len)
        x = self.embed_tokens(tokens)
        cos = self.rope_cos[positions].to(x.dtype)
        sin = self.rope_sin[positions].to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, positions, kv_len, causal_tail)
        return self.norm(x)

    @staticmethod
    def _prefetch_next(block: nn.Module, h: Tensor, early: bool = False, ahead: int = 1) -> None:
        """Let a later layer's tiered experts stage their predicted host experts now (its router on
        h, on a side stream; see TieredExperts.prefetch). One-token steps only. early: h is this
        layer's attention input and this layer's experts have not run yet (own copy stream).
        ahead: how many layers later the block is (beyond 1 only ssd guesses act on it)."""
        if isinstance(block, MoEBlock) and block.experts.prefetching and h.numel() == h.shape[-1]:
            block.experts.prefetch(h.reshape(1, -1), block.gate.weight, block.top_k, block.norm_topk_prob,
                                   own_stream=early, ahead=ahead)

    def _fused_layers(self, tokens: Tensor, positions: Tensor, kv_len: int) -> Tensor:
        """DecoderLayer.forward for every layer, with each residual add fused into the next RMSNorm
        (the next layer's input norm, or the final norm): one kernel where there were ~9. The MoE
        blocks' weighted expert sums are done by that same kernel where the experts allow it, and
        their routers run inside the post-attention norm's kernel (add_rmsnorm_router) where they can.
        The embedding lookup runs in the first norm's launch, and the RoPE kernels read the cos / sin
        tables at the positions themselves: no gather launches before the first layer."""
        from . import kernels
        cfg = self.decode
        first = self.layers[0].input_layernorm
        x, h = kernels.embed_rmsnorm(self.embed_tokens.weight, tokens, first.weight, first.eps, cfg=cfg)
        cos, sin = self.rope_cos, self.rope_sin
        tokens = x.numel() // x.shape[-1]
        for i, layer in enumerate(self.layers):
            # prefetch_early: guess layer l+1's host experts from layer l's attention input, one
            # sublayer earlier than its MoE input: the stage copies overlap layer l's attention too
            if cfg.prefetch_early and i + 1 < len(self.layers):
                self._prefetch_next(self.layers[i + 1].mlp, h, early=True)   # h: this layer's attention input
                # the SSD tier's reads take longer than a layer: guesses for layers further on too
                for d in range(2, min(cfg.ssd_lookahead, len(self.layers) - 1 - i) + 1):
                    self._prefetch_next(self.layers[i + d].mlp, h, early=True, ahead=d)
            a = layer.self_attn(h, cos, sin, positions, kv_len)
            post = layer.post_attention_layernorm
            block = layer.mlp
            routes = xq = None
            if isinstance(block, MoEBlock) and block.norm_router_ok(tokens):
                # experts with int8 activations get h's int8 rows from this launch too
                quant = block.experts.wants_quantized_x() and x.shape[-1] % GROUP == 0
                # l2_prefetch "next_qkv": the next layer's [q; k; v] is asked for while this one routes
                nxt_qkv = self.layers[i + 1].self_attn.qkv_weight if i + 1 < len(self.layers) else None
                x, h, *routed = kernels.add_rmsnorm_router(x, a, post.weight, post.eps, block.gate.weight,
                                                           block.top_k, block.norm_topk_prob, quantize_h=quant, cfg=cfg,
                                                           prefetch=nxt_qkv)
                if quant:
                    *routed, xq = routed
                routes = tuple(routed)
            else:
                x, h = kernels.add_rmsnorm(x, a, post.weight, post.eps, cfg=cfg)
            nxt = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            part = out = None
            if cfg.defer_moe_sum and isinstance(block, MoEBlock):
                part = block.forward_partials(h, routes, xq)     # the MoE sum moves into the next norm
            if part is None:
                out = block(h) if routes is None else block(h, routes)
            if not cfg.prefetch_early and i + 1 < len(self.layers):
                # after this layer's experts: the copies queue behind its host launches on the lane
                self._prefetch_next(self.layers[i + 1].mlp, h)     # h: this layer's MoE input
            if part is not None:
                x, h = kernels.add_rmsnorm(x, part, nxt.weight, nxt.eps, delta_rows=block.top_k, cfg=cfg)
            else:
                x, h = kernels.add_rmsnorm(x, out, nxt.weight, nxt.eps, cfg=cfg)
        return h
