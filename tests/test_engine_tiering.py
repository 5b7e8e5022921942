"""Tiering end to end on a tiny random Qwen3-MoE checkpoint (transformers save_pretrained) fed with
real WikiText bytes: calibrate -> plan -> pack -> load, placement invariance and telemetry."""
from __future__ import annotations

import json

import pytest
import torch

from moebench.engine import Engine
from moebench.engine.decode_config import DecodeConfig
from moebench.engine.placement import QuantizedExpert, TieredExperts, collect_telemetry, find_tiered
from moebench.engine.quant import quantize
from moebench.engine.tiering import (Budgets, CalibrationStats, Plan, TieringError, calibrate, expert_nbytes,
                                     measure_errors, pack, plan, plan_hot_cold)

E, TOP_K, H, I, LAYERS, SEQ = 8, 2, 64, 96, 2, 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=256, hidden_size=H, intermediate_size=128, moe_intermediate_size=I, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=E, num_experts_per_tok=TOP_K,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], initializer_range=0.1,
        max_position_embeddings=512, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    path = tmp_path_factory.mktemp("tiny_qwen3moe")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def wiki_batches(data_dir):
    # Real text as byte-level tokens (the tiny model's vocabulary is the 256 byte values).
    text = (data_dir / "wikitext2" / "wiki.test.raw").read_bytes()[:20000].replace(b"\r\n", b"\n")
    return [list(text[i:i + SEQ]) for i in range(0, 6 * SEQ, SEQ)]


@pytest.fixture(scope="module")
def stats(ckpt, wiki_batches):
    engine = Engine.load(ckpt, device="cpu", dtype="float32")
    return calibrate(engine, wiki_batches, samples_per_expert=16)


def test_calibration_counts_and_round_trip(stats, ckpt, wiki_batches, tmp_path):
    tokens = sum(len(b) for b in wiki_batches)
    assert stats.tokens == tokens and stats.top_k == TOP_K and stats.layers == list(range(LAYERS))
    assert stats.counts.sum(dim=1).tolist() == [tokens * TOP_K] * LAYERS
    # Counts agree with the engine's own router trace, expert by expert.
    engine = Engine.load(ckpt, device="cpu", dtype="float32")
    want = torch.zeros(LAYERS, E, dtype=torch.int64)
    for b in wiki_batches:
        trace = engine.trace(b, router_logits=False)
        for l, ids in zip(trace.layers, trace.topk_ids):
            want[l] += torch.bincount(ids.flatten(), minlength=E)
    assert torch.equal(stats.counts, want)
    assert stats.counts.max() > 2 * stats.counts.min()       # real text routes unevenly
    used = stats.counts > 0
    assert (stats.imatrix_in.sum(-1)[used] > 0).all() and (stats.imatrix_mid.sum(-1)[used] > 0).all()
    assert stats.sample_count.max() == 16 and stats.samples[0, 0].abs().sum() > 0
    stats.save(tmp_path / "calib.safetensors")
    back = CalibrationStats.load(tmp_path / "calib.safetensors")
    assert back.layers == stats.layers and back.tokens == stats.tokens
    for name in ("counts", "imatrix_in", "imatrix_mid", "samples", "sample_count"):
        assert torch.equal(getattr(back, name), getattr(stats, name)), name


def _plan_bytes(p: Plan, hidden=H, inter=I) -> dict[str, int]:
    used = {"gpu": 0, "host": 0}
    for precs, homes in zip(p.precision, p.home):
        for fmt, home in zip(precs, homes):
            used[home] += expert_nbytes(fmt, hidden, inter)
    return used


def test_greedy_planner_prefers_hot_experts_and_respects_budgets():
    # Identical experts, so measured errors are equal and only usage can order the choices.
    g = torch.Generator().manual_seed(0)
    wg, wu, wd = (torch.randn(I, H, generator=g) * 0.1, torch.randn(I, H, generator=g) * 0.1,
                  torch.randn(H, I, generator=g) * 0.1)
    weights = {0: (wg.expand(E, I, H), wu.expand(E, I, H), wd.expand(E, H, I))}
    counts = torch.tensor([[400, 200, 100, 50, 25, 12, 6, 3]])
    x = torch.randn(1, E, 8, H, generator=g)
    st = CalibrationStats(layers=[0], num_experts=E, top_k=2, tokens=400, counts=counts,
                          imatrix_in=torch.ones(1, E, H, dtype=torch.float64) * counts[..., None],
                          imatrix_mid=torch.ones(1, E, I, dtype=torch.float64) * counts[..., None],
                          samples=x, sample_count=torch.full((1, E), 8))
    sizes = {f: expert_nbytes(f, H, I) for f in ("bf16", "int8", "int4", "ternary")}
    budgets = Budgets(gpu_bytes=2 * sizes["int8"] + 10, host_bytes=6 * sizes["ternary"] + 2 * sizes["int4"])
    p = plan(st, weights, budgets, ["bf16", "int8", "int4", "ternary"])
    used = _plan_bytes(p)
    assert used["gpu"] <= budgets.gpu_bytes and used["host"] <= budgets.host_bytes
    assert used == p.info["bytes"]
    rank = {"ternary": 0, "int4": 1, "int8": 2, "bf16": 3}
    levels = [rank[f] for f in p.precision[0]]
    assert levels == sorted(levels, reverse=True), p.precision      # hotter never gets less precision
    assert levels[0] > levels[-1]
    homes = p.home[0]
    assert homes[0] == "gpu" and homes[-1] == "host"
    # A generous budget puts everything at bf16 on the GPU.
    rich = plan(st, weights, Budgets(E * sizes["bf16"], 0), ["bf16", "int8", "int4", "ternary"])
    assert rich.precision[0] == ["bf16"] * E and rich.home[0] == ["gpu"] * E
    with pytest.raises(TieringError, match="infeasible"):
        plan(st, weights, Budgets(sizes["ternary"], sizes["ternary"]), ["int8", "ternary"])


def test_plan_on_real_stats_save_load(stats, ckpt, tmp_path):
    sizes = {f: expert_nbytes(f, H, I) for f in ("int8", "int4", "ternary")}
    n = LAYERS * E
    budgets = Budgets(gpu_bytes=4 * sizes["int8"], host_bytes=n * sizes["int4"] // 2)
    p = plan(stats, ckpt, budgets, ["int8", "int4", "ternary"])
    used = _plan_bytes(p)
    assert used["gpu"] <= budgets.gpu_bytes and used["host"] <= budgets.host_bytes
    assert len(set(f for row in p.precision for f in row)) >= 2       # the budget forces a mix
    assert p.info["expected_error"] > 0
    for metric in ("output", "imatrix"):
        err = measure_errors(stats, ckpt, ["int8", "ternary"], metric)
        used = stats.counts > 0
        assert (err[..., 0][used] < err[..., 1][used]).all(), metric
    p.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert (back.layers, back.precision, back.home) == (p.layers, p.precision, p.home)
    data = json.loads((tmp_path / "plan.json").read_text())
    data["layers"]["1"]["home"][3] = "tape"
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(TieringError, match=r"layers\.1\.home\[3\] is 'tape'; expected one of \('gpu', 'host', 'ssd'\)"):
        Plan.load(tmp_path / "bad.json")


def _mixed_plan(stats, homes_all_gpu: bool, cache_slots=1) -> Plan:
    p = plan_hot_cold(stats, 0.25, hot="int8", cold="ternary", cache_slots=cache_slots)
    for l in range(LAYERS):
        p.precision[l][5] = "int4"          # a third format in the mix
        p.precision[l][6] = "int4_asym+r4"
        if homes_all_gpu:
            p.home[l] = ["gpu"] * E
    return p


def test_placement_never_changes_numbers_and_telemetry_adds_up(stats, ckpt, wiki_batches, tmp_path):
    split = pack(ckpt, _mixed_plan(stats, homes_all_gpu=False), tmp_path / "split")
    resident = pack(ckpt, _mixed_plan(stats, homes_all_gpu=True), tmp_path / "resident")
    assert (split / "config.json").is_file() and (split / "experts.safetensors").is_file()
    art = json.loads((split / "plan.json").read_text())["artifact"]
    assert art["expert_bytes_by_home"] == _plan_bytes(_mixed_plan(stats, homes_all_gpu=False))
    assert sum(art["expert_bytes_by_home"].values()) == art["expert_bytes"]
    e_split = Engine.load(split, device="cpu", dtype="float32")
    e_res = Engine.load(resident, device="cpu", dtype="float32")
    layers = find_tiered(e_split.model)
    assert len(layers) == LAYERS and layers[0].homes.count("host") == E - 2
    ids = wiki_batches[0]
    for _ in range(2):                       # the second pass starts with a warm cache
        assert torch.equal(e_split.logits(ids), e_res.logits(ids))
    tel = collect_telemetry(e_split.model)
    trace = e_res.trace(ids, router_logits=False)
    for l, (layer, tids) in enumerate(zip(tel["layers"], trace.topk_ids)):
        on_gpu = [e for e, h in enumerate(layers[l].homes) if h == "gpu"]
        assert layer["tokens_gpu"] == 2 * int(torch.isin(tids, torch.tensor(on_gpu)).sum())
        # plan_hot_cold put each layer's two most used experts on the gpu
        assert set(on_gpu) == set(torch.argsort(stats.counts[l], descending=True)[:2].tolist())
    for layer in tel["layers"]:
        routed = 2 * len(ids) * TOP_K
        assert layer["routed"] == routed
        assert layer["tokens_gpu"] + layer["tokens_host_hit"] + layer["tokens_host_miss"] == routed
        assert layer["cache_misses"] > 0 and layer["bytes_h2d"] > 0 and layer["tokens_skipped"] == 0
    res_tel = collect_telemetry(e_res.model)["total"]
    assert res_tel["tokens_gpu"] == res_tel["routed"] and res_tel["bytes_h2d"] == 0


def test_route_tail_skip_drops_only_cold_tail(stats, ckpt, wiki_batches, tmp_path):
    art = pack(ckpt, _mixed_plan(stats, homes_all_gpu=False, cache_slots=0), tmp_path / "art")
    base = Engine.load(art, device="cpu", dtype="float32")
    skip = Engine.load(art, device="cpu", dtype="float32")
    for m in find_tiered(skip.model):
        m.skip_tail_from = 1
    ids = wiki_batches[1]
    a, b = base.logits(ids), skip.logits(ids)
    assert not torch.equal(a, b)
    for layer in collect_telemetry(skip.model)["layers"]:
        assert layer["tokens_skipped"] > 0
        assert (layer["tokens_gpu"] + layer["tokens_host_hit"] + layer["tokens_host_miss"]
                + layer["tokens_skipped"]) == len(ids) * TOP_K


def test_ternary_cold_costs_more_than_int8_cold(stats, ckpt, wiki_batches, tmp_path):
    ref = Engine.load(ckpt, device="cpu", dtype="float32")
    err = {}
    for cold in ("int8", "ternary"):
        art = pack(ckpt, plan_hot_cold(stats, 0.25, hot="int8", cold=cold), tmp_path / cold)
        cand = Engine.load(art, device="cpu", dtype="float32")
        err[cold] = sum(((cand.logits(b) - ref.logits(b)) ** 2).mean().item() for b in wiki_batches[:2])
    assert 0 < err["int8"] < err["ternary"], err


def test_all_bf16_artifact_matches_dense_engine(stats, ckpt, wiki_batches, tmp_path):
    p = plan_hot_cold(stats, 0.5, hot="bf16", cold="bf16")
    art = pack(ckpt, p, tmp_path / "bf16")
    dense = Engine.load(ckpt, device="cpu", dtype="bfloat16")
    tiered = Engine.load(art, device="cpu", dtype="bfloat16")
    a, b = dense.logits(wiki_batches[2]), tiered.logits(wiki_batches[2])
    # Same weights, same dtype; only the experts' summation order differs.
    assert (a - b).abs().max() <= 0.02 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95


def test_tiered_experts_match_dense_math():
    g = torch.Generator().manual_seed(1)
    ws = [(torch.randn(I, H, generator=g) * .1, torch.randn(I, H, generator=g) * .1,
           torch.randn(H, I, generator=g) * .1) for _ in range(4)]
    experts = [QuantizedExpert(*(quantize(w, "bf16") for w in t)) for t in ws]
    m = TieredExperts(experts, ["gpu", "host", "host", "gpu"], "cpu", torch.float32, cache_slots=1)
    x = torch.randn(5, H, generator=g)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [2, 1]])
    w = torch.rand(5, 2, generator=g)
    want = torch.zeros(5, H)
    for t in range(5):
        for j in range(2):
            gt, ut, dt = (a.to(torch.bfloat16).float() for a in ws[int(ids[t, j])])
            want[t] += w[t, j] * ((torch.nn.functional.silu(gt @ x[t]) * (ut @ x[t])) @ dt.T)
    assert torch.allclose(m(x, ids, w), want, atol=1e-5)
    tel = m.telemetry()
    assert tel["cache_misses"] == 2 and tel["cache_hits"] == 0 and tel["tokens_host_miss"] == 6


GROUPED_FORMATS = ["int8", "int4", "ternary", "int4_asym+r4", "bf16", "ternary2", "int8", "int4"]


def _mixed_experts(seed: int, formats: list[str] = GROUPED_FORMATS) -> list[QuantizedExpert]:
    g = torch.Generator().manual_seed(seed)
    return [QuantizedExpert(*(quantize(torch.randn(*s, generator=g) * .1, f) for s in ((I, H), (I, H), (H, I))))
            for f in formats]


def _module(experts, homes, device, dtype, cache_slots=1, **decode) -> TieredExperts:
    m = TieredExperts(experts, homes, device, dtype, cache_slots=cache_slots)
    m.configure(DecodeConfig(**decode), TOP_K)
    return m


def test_grouped_path_numbers_do_not_depend_on_placement_or_chunks():
    """experts_impl "grouped_mm" on the CPU (the path prefill takes with "triton" on CUDA): six
    formats over gpu and host homes give exactly the all-resident module's output whatever the
    stack budget (one expert per chunk, three, all at once), on a cold and on a warm cache, where a
    later chunk's cached expert is evicted by an earlier chunk's fetches; the output agrees with the
    per-expert path and the telemetry counts every pick once."""
    experts = _mixed_experts(4)
    homes = ["gpu", "host", "host", "gpu", "host", "host", "gpu", "host"]
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, H, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:TOP_K] for _ in range(40)])
    w = torch.rand(40, TOP_K, generator=g)
    per_expert = _module(experts, homes, "cpu", torch.float32)
    want = per_expert(x, ids, w)
    one = 3 * I * H * 4                       # one expert's float32 gate, up and down
    for budget in (1, 3 * one, 1 << 30):
        resident = _module(experts, ["gpu"] * 8, "cpu", torch.float32, experts_impl="grouped_mm",
                           tiered_stack_bytes=budget)
        split = _module(experts, homes, "cpu", torch.float32, experts_impl="grouped_mm", tiered_stack_bytes=budget)
        assert split._grouped_runs(x) and not per_expert._grouped_runs(x)
        # all eight resident experts in one stack: no routing on the host (the split module always needs it)
        assert resident._grouped_in_one_stack(TOP_K, x.dtype) == (budget == 1 << 30)
        assert not split._grouped_in_one_stack(TOP_K, x.dtype)
        ref = resident(x, ids, w)
        for _ in range(2):                    # the second call finds the last fetched host expert cached
            assert torch.equal(split(x, ids, w), ref), budget
        assert torch.allclose(ref, want, atol=1e-5, rtol=0)
        rtel = resident.telemetry()
        assert rtel["picks_gpu"] == rtel["routed"] == 40 * TOP_K, (budget, rtel)
        tel = split.telemetry()
        assert tel["tokens_gpu"] + tel["tokens_host_hit"] + tel["tokens_host_miss"] == 2 * 40 * TOP_K
        assert tel["cache_hits"] == 1 and tel["cache_misses"] == 2 * 5 - 1, (budget, tel)


def test_grouped_path_route_tail_skip_leaves_out_the_same_picks():
    """Route-tail-skip on the grouped path: the skipped (cold, ranked last) picks contribute nothing,
    as on the per-expert path: the same output within rounding and the same counts."""
    experts = _mixed_experts(6)
    homes = ["gpu", "host"] * 4
    g = torch.Generator().manual_seed(7)
    x = torch.randn(32, H, generator=g)
    ids = torch.stack([torch.randperm(8, generator=g)[:TOP_K] for _ in range(32)])
    w = torch.rand(32, TOP_K, generator=g)
    outs, tels = [], []
    for decode in ({}, {"experts_impl": "grouped_mm"}):
        m = _module(experts, homes, "cpu", torch.float32, cache_slots=0, **decode)
        m.skip_tail_from = 1
        outs.append(m(x, ids, w))
        tels.append(m.telemetry())
    assert torch.allclose(outs[0], outs[1], atol=1e-5, rtol=0)
    assert tels[0]["tokens_skipped"] == tels[1]["tokens_skipped"] > 0
    assert {k: tels[0][k] for k in ("tokens_gpu", "tokens_host_miss", "cache_misses")} == \
        {k: tels[1][k] for k in ("tokens_gpu", "tokens_host_miss", "cache_misses")}


def test_grouped_path_out_of_memory_names_the_stack_setting(monkeypatch):
    """Running out of memory on the grouped path says which setting sizes its stacks, on both of its
    ways (one stack without host routing, ranges with it)."""
    def no_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(TieredExperts, "_swiglu_grouped", staticmethod(no_memory))
    x, ids, w = torch.randn(4, H), torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0]]), torch.rand(4, TOP_K)
    for homes in (["gpu"] * 8, ["gpu", "host"] * 4):
        m = _module(_mixed_experts(10), homes, "cpu", torch.float32, experts_impl="grouped_mm",
                    tiered_stack_bytes=64 << 20)
        with pytest.raises(torch.OutOfMemoryError, match=r"Tried to allocate 2.00 GiB\n\(tiered experts' grouped "
                           r"path: a stack holds up to 64 MiB .* tiered_stack_mib\)"):
            m(x, ids, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (torch's grouped GEMM in bf16)")
def test_cuda_grouped_prefill_numbers_do_not_depend_on_placement():
    """experts_impl "triton" on CUDA: a 64-token step (beyond the fused path) runs the grouped path;
    host and gpu homes (routing on the host) give exactly the all-resident output (in one stack
    without the routing on the host, or in one stack per expert), close to the per-expert path's."""
    # the fused kernels (experts_impl "triton") take no low-rank formats
    experts = _mixed_experts(8, [f.split("+")[0] for f in GROUPED_FORMATS])
    homes = ["gpu", "gpu"] + ["host"] * 6
    g = torch.Generator().manual_seed(9)
    x = torch.randn(64, H, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:TOP_K] for _ in range(64)]).cuda()
    w = torch.rand(64, TOP_K, generator=g).cuda()
    per_expert = _module(experts, ["gpu"] * 8, "cuda", torch.bfloat16)(x, ids, w)
    for budget in (1, 1 << 30):
        resident = _module(experts, ["gpu"] * 8, "cuda", torch.bfloat16, experts_impl="triton",
                           tiered_stack_bytes=budget)
        split = _module(experts, homes, "cuda", torch.bfloat16, cache_slots=2, experts_impl="triton",
                        tiered_stack_bytes=budget)
        assert split._grouped_runs(x) and not split._grouped_in_one_stack(TOP_K, x.dtype)
        assert resident._grouped_in_one_stack(TOP_K, x.dtype) == (budget == 1 << 30)   # no host sync then
        ref = resident(x, ids, w)
        for _ in range(2):
            assert torch.equal(split(x, ids, w), ref), budget
        assert (ref.float() - per_expert.float()).abs().max() <= 0.02 * per_expert.float().abs().max()


def test_load_tiered_rejects_mismatched_model(stats, ckpt, tmp_path):
    art = pack(ckpt, plan_hot_cold(stats, 0.5), tmp_path / "art")
    data = json.loads((art / "plan.json").read_text())
    data["layers"]["7"] = data["layers"]["1"]
    (art / "plan.json").write_text(json.dumps(data))
    with pytest.raises(TieringError, match="plan covers layers"):
        Engine.load(art, device="cpu", dtype="float32")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (pinned host tier, copy stream)")
def test_cuda_host_tier_is_pinned_and_matches_resident():
    g = torch.Generator().manual_seed(2)
    fmts = ["int8", "int4", "ternary", "int4_asym+r4"] * 2
    experts = [QuantizedExpert(*(quantize(torch.randn(*s, generator=g) * .1, f) for s in ((I, H), (I, H), (H, I))))
               for f in fmts]
    homes = ["gpu", "gpu"] + ["host"] * 6
    split = TieredExperts(experts, homes, "cuda", torch.bfloat16, cache_slots=2)
    resident = TieredExperts(experts, ["gpu"] * 8, "cuda", torch.bfloat16)
    assert all(t.is_pinned() for s in split._stores[2:] for q in (s.gate, s.up, s.down) for t in q.parts.values())
    x = torch.randn(64, H, generator=g).to("cuda", torch.bfloat16)
    ids = torch.stack([torch.randperm(8, generator=g)[:TOP_K] for _ in range(64)]).cuda()
    w = torch.rand(64, TOP_K, generator=g).cuda()
    for _ in range(3):
        assert torch.equal(split(x, ids, w), resident(x, ids, w))
    torch.cuda.synchronize()
    tel = split.telemetry()
    assert tel["tokens_gpu"] + tel["tokens_host_hit"] + tel["tokens_host_miss"] == 3 * 64 * TOP_K
    assert tel["cache_misses"] >= 6 and tel["bytes_h2d"] > 0
