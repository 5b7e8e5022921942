"""The SSD tier on the CPU: a tiny random Qwen3-MoE checkpoint (transformers save_pretrained),
calibrated on real WikiText bytes, packed with its coldest experts in experts.ssd behind a small
host-RAM cache, decodes exactly what the all-resident artifact decodes, on the per-expert path and
on the fused one (Triton's interpreter, where triton is installed; with and without guessed
reads); the telemetry adds up; the
LRU keeps to its byte budget; a damaged pack file is refused with a message naming it."""
from __future__ import annotations

import json
import os
import shutil
import struct

import pytest
import torch

from conftest import fused_kernels_or_skip

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton's first import (see kernels/runtime.py)

from moebench.engine import Engine  # noqa: E402
from moebench.engine.placement import collect_telemetry, find_tiered  # noqa: E402
from moebench.engine.ssd import (ALIGN, MAGIC, READ_CHUNK_BYTES, READ_THREADS, DiskTier, ExpertPack,  # noqa: E402
                                 HostCache, PackError, chunk_ranges, write_pack)
from moebench.engine.tiering import (Budgets, Plan, TieringError, calibrate, expert_nbytes, pack, plan,  # noqa: E402
                                     plan_hot_cold, read_experts)

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
    path = tmp_path_factory.mktemp("ssd_ckpt")
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def batches(data_dir):
    text = (data_dir / "wikitext2" / "wiki.test.raw").read_bytes()[:20000].replace(b"\r\n", b"\n")
    return [list(text[i:i + SEQ]) for i in range(0, 4 * SEQ, SEQ)]


@pytest.fixture(scope="module")
def stats(ckpt, batches):
    return calibrate(Engine.load(ckpt, device="cpu", dtype="float32"), batches, samples_per_expert=8)


def _three_tier_plan(stats, cache_bytes: int) -> Plan:
    """Hot quarter int8 on the gpu; the coldest half on ssd, the rest on host; three cold formats."""
    p = plan_hot_cold(stats, 0.25, hot="int8", cold="ternary", cache_slots=1, ssd_fraction=0.5,
                      ssd_cache_bytes=cache_bytes)
    for l in range(LAYERS):
        ranked = sorted(range(E), key=lambda e: (-int(stats.counts[l, e]), e))
        p.precision[l][ranked[-1]] = "int4"
        p.precision[l][ranked[-2]] = "int4_asym+r4"
    return p


@pytest.fixture(scope="module")
def artifacts(ckpt, stats, tmp_path_factory):
    root = tmp_path_factory.mktemp("ssd_art")
    record = ALIGN * -(-expert_nbytes("int4_asym+r4", H, I) // ALIGN)
    split_plan = _three_tier_plan(stats, cache_bytes=2 * record)   # room for two of the eight ssd experts
    res_plan = _three_tier_plan(stats, cache_bytes=0)
    res_plan.home = [["gpu"] * E for _ in range(LAYERS)]
    return pack(ckpt, split_plan, root / "split"), pack(ckpt, res_plan, root / "resident"), split_plan


def _logits_of_generate(eng: Engine, prompt: list[int], new: int) -> list[torch.Tensor]:
    """Every logits output (MoETransformer.logits) of a greedy generate: the prefill's, then one per
    decode step."""
    seen: list[torch.Tensor] = []
    real = eng.model.logits

    def logits(h, decode=False):
        out = real(h, decode)
        seen.append(out.detach().clone())
        return out
    eng.model.logits = logits
    try:
        eng.generate([prompt], new, ignore_eos=True)
    finally:
        del eng.model.logits
    return seen


def test_pack_layout_and_plan_file(artifacts, stats):
    split, resident, split_plan = artifacts
    data = json.loads((split / "plan.json").read_text())
    art = data["artifact"]
    assert art["ssd_file"] == "experts.ssd" and (split / "experts.ssd").stat().st_size == art["ssd_file_bytes"]
    assert data["runtime"]["ssd_cache_bytes"] == split_plan.ssd_cache_bytes and data["runtime"]["ssd_direct"] is None
    assert sum(art["expert_bytes_by_home"].values()) == art["expert_bytes"] and art["expert_bytes_by_home"]["ssd"] > 0
    # the resident artifact keeps the old layout: no ssd keys, no pack file
    res = json.loads((resident / "plan.json").read_text())
    assert "ssd_cache_bytes" not in res["runtime"] and "ssd" not in res["artifact"]["expert_bytes_by_home"]
    assert not (resident / "experts.ssd").exists()
    p = ExpertPack(split / "experts.ssd")
    on_ssd = {(l, e) for l in range(LAYERS) for e in range(E) if split_plan.home[l][e] == "ssd"}
    assert set(p.entries) == on_ssd and len(on_ssd) == LAYERS * E // 2
    for (l, e), entry in p.entries.items():
        assert entry["offset"] % ALIGN == 0 and entry["read_bytes"] % ALIGN == 0
        assert entry["format"] == split_plan.precision[l][e]
        # the parts' bytes, each part starting on a 64-byte boundary (at most 9 parts per expert)
        assert expert_nbytes(entry["format"], H, I) <= entry["length"] < expert_nbytes(entry["format"], H, I) + 9 * 64
    # ssd experts are only in the pack; the bytes read back equal what pack quantized
    experts = read_experts(split)
    assert all((experts[l][e] is None) == ((l, e) in on_ssd) for l in range(LAYERS) for e in range(E))
    full = read_experts(resident)
    verify = ExpertPack(split / "experts.ssd", verify=True)
    for key in sorted(on_ssd):
        got, nbytes = verify.read(key)
        assert nbytes == verify.entries[key]["read_bytes"]
        want = full[key[0]][key[1]]
        for mat in ("gate", "up", "down"):
            a, b = getattr(got, mat), getattr(want, mat)
            assert a.fmt == b.fmt and a.shape == b.shape and a.parts.keys() == b.parts.keys()
            assert all(torch.equal(a.parts[k], b.parts[k]) for k in a.parts)


@pytest.mark.parametrize("direct, chunk", [(None, None), (False, None), (None, ALIGN)])
def test_ssd_tier_gives_the_same_logits_and_counts_every_pick(artifacts, batches, direct, chunk, tmp_path):
    split, resident, split_plan = artifacts
    if direct is False or chunk:     # buffered reads (ssd_direct = false) or one-page chunks on 3 threads
        copy = tmp_path / "changed"
        shutil.copytree(split, copy)
        data = json.loads((copy / "plan.json").read_text())
        if direct is False:
            data["runtime"]["ssd_direct"] = False
        if chunk:
            data["runtime"].update(ssd_chunk_bytes=chunk, ssd_threads=3)
        (copy / "plan.json").write_text(json.dumps(data))
        split = copy
    e_ssd = Engine.load(split, device="cpu", dtype="float32")
    e_res = Engine.load(resident, device="cpu", dtype="float32")
    mods = find_tiered(e_ssd.model)
    disk = mods[0].disk
    assert disk is not None and all(m.disk is disk for m in mods)
    if direct is False:
        assert disk.pack.direct is False
    if chunk:                                 # some records really are read in several chunks
        assert disk.chunk_bytes == chunk and disk.threads == 3
        assert max(disk.pack.read_bytes(k) for k in disk.pack.entries) > chunk
    prompt, new = batches[0][:48], 10
    a = _logits_of_generate(e_ssd, prompt, new)
    b = _logits_of_generate(e_res, prompt, new)
    assert len(a) == len(b) == new            # the prefill, then new - 1 decode steps
    for step, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"logits differ at step {step}"
    # a second prompt starts with warm caches and still matches
    assert torch.equal(e_ssd.logits(batches[1][:40]), e_res.logits(batches[1][:40]))

    tel = e_ssd.telemetry()["tiers"]
    routed = (len(prompt) + new - 1 + 40) * TOP_K
    for m, layer in zip(mods, tel["layers"]):
        assert layer["routed"] == routed == layer["picks_gpu"] + layer["picks_host"] + layer["picks_ssd"]
        assert layer["picks_ssd"] > 0
        assert layer["ssd_hits"] + layer["ssd_misses"] == layer["picks_ssd"] and layer["ssd_skips"] == 0
        assert layer["ssd_gpu_hits"] <= layer["ssd_hits"]
        assert layer["ssd_reads"] > 0 and layer["ssd_misses"] >= layer["ssd_reads"]
        record = {e: disk.pack.read_bytes((m.layer, e)) for e, h in enumerate(m.homes) if h == "ssd"}
        assert min(record.values()) * layer["ssd_reads"] <= layer["bytes_ssd_read"] \
            <= max(record.values()) * layer["ssd_reads"]
        assert layer["ssd_wait_s"] >= 0.0
        assert layer["host_hits"] + layer["host_misses"] == layer["picks_host"]
    total = tel["total"]
    assert total["ssd_gpu_hits"] > 0                                   # served by the device cache
    assert total["ssd_hits"] > total["ssd_gpu_hits"]                    # and by the host-RAM cache
    assert total["ssd_hits"] + total["ssd_misses"] == total["picks_ssd"]
    # the ssd picks are exactly the routed picks of the ssd experts (routing from the resident engine)
    e_res.reset_telemetry()
    e_res.logits(batches[2][:64])
    e_ssd.reset_telemetry()
    e_ssd.logits(batches[2][:64])
    trace = e_res.trace(batches[2][:64], router_logits=False)
    for m, layer, ids in zip(mods, e_ssd.telemetry()["tiers"]["layers"], trace.topk_ids):
        on_ssd = torch.tensor([e for e, h in enumerate(m.homes) if h == "ssd"])
        assert layer["picks_ssd"] == int(torch.isin(ids, on_ssd).sum())
        assert layer["ssd_hits"] + layer["ssd_misses"] == layer["picks_ssd"]
    st = collect_telemetry(e_ssd.model)["disk"]
    assert st["cache_peak_bytes"] <= st["cache_capacity_bytes"] == split_plan.ssd_cache_bytes
    assert st["cache_evictions"] > 0 and 0 < st["cache_resident_bytes"] <= st["cache_capacity_bytes"]
    assert st["o_direct"] == (direct is None and disk.pack.direct)


def test_grouped_path_gives_the_resident_artifacts_logits(artifacts, batches):
    """experts_impl "grouped_mm" (tiered experts' grouped GEMMs in every step on the CPU): the split
    artifact, its experts of four formats on the gpu, host and ssd tiers, decodes exactly what the
    all-resident artifact decodes on that path, close to the per-expert path's logits, and counts
    every ssd pick."""
    split, resident, _ = artifacts
    e_ssd = Engine.load(split, device="cpu", dtype="float32", experts_impl="grouped_mm")
    e_res = Engine.load(resident, device="cpu", dtype="float32", experts_impl="grouped_mm")
    e_per = Engine.load(resident, device="cpu", dtype="float32")
    assert all(m._grouped_runs(torch.zeros(1, H)) for m in find_tiered(e_ssd.model))
    prompt, new = batches[3][:48], 6
    a, b, c = (_logits_of_generate(e, prompt, new) for e in (e_ssd, e_res, e_per))
    assert len(a) == len(b) == len(c) == new
    for step, (x, y, z) in enumerate(zip(a, b, c)):
        assert torch.equal(x, y), f"logits differ at step {step}"
        assert torch.allclose(y, z, atol=1e-4, rtol=0), f"grouped and per-expert paths differ at step {step}"
    total = e_ssd.telemetry()["tiers"]["total"]
    assert total["routed"] == LAYERS * (len(prompt) + new - 1) * TOP_K
    assert total["ssd_reads"] > 0 and total["ssd_hits"] + total["ssd_misses"] == total["picks_ssd"] > 0
    assert total["host_hits"] + total["host_misses"] == total["picks_host"] > 0


def test_route_tail_skip_counts_ssd_picks(artifacts, batches):
    split, _, _ = artifacts
    eng = Engine.load(split, device="cpu", dtype="float32")
    for m in find_tiered(eng.model):
        m.skip_tail_from = 1
    eng.logits(batches[3][:64])
    for layer in eng.telemetry()["tiers"]["layers"]:
        assert layer["ssd_skips"] > 0
        assert layer["ssd_hits"] + layer["ssd_misses"] + layer["ssd_skips"] == layer["picks_ssd"]
        assert layer["host_hits"] + layer["host_misses"] + layer["route_tail_skips"] == layer["picks_host"]


def test_o_direct_refused_falls_back_to_buffered_reads(artifacts, monkeypatch):
    import errno
    import os

    from moebench.engine import ssd
    split, _, _ = artifacts
    real_open = os.open

    def no_direct(path, flags, *a):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(ssd.os, "open", no_direct)
    p = ExpertPack(split / "experts.ssd")
    assert p.direct is False and "refused O_DIRECT" in p.direct_reason
    key = next(iter(p.entries))
    got, n = p.read(key)
    assert n == p.read_bytes(key) and got.fmt == p.entries[key]["format"]
    with pytest.raises(PackError, match="open with O_DIRECT failed"):
        ExpertPack(split / "experts.ssd", direct=True)


def test_host_cache_lru_respects_its_byte_budget(artifacts):
    split, _, _ = artifacts
    p = ExpertPack(split / "experts.ssd")
    keys = sorted(p.entries)
    sizes = {k: p.read_bytes(k) for k in keys}
    cap = sizes[keys[0]] + sizes[keys[1]] + sizes[keys[2]] - 1       # never three of these at once
    cache = HostCache(cap)
    order = keys[:3] + [keys[0]] + keys[3:6] + [keys[4]]
    ref: list = []                                                  # the LRU order a byte-sized cache must keep
    for k in order:
        expert, n = p.read(k)
        hit = cache.get(k) is not None
        assert hit == (k in ref)
        if not hit:
            cache.put(k, expert, n)
            ref.append(k)
            while sum(sizes[x] for x in ref) > cap:
                ref.pop(0)
        else:
            ref.remove(k)
            ref.append(k)
        assert cache.keys() == ref and cache.resident == sum(sizes[x] for x in ref) <= cap
    assert cache.evictions > 0 and cache.peak <= cap
    big = HostCache(sizes[keys[0]] - 1)                             # smaller than any record: keeps nothing
    assert not big.put(keys[0], p.read(keys[0])[0], sizes[keys[0]]) and big.resident == 0
    tier = DiskTier(p, cache_bytes=cap, threads=2)
    futures = [tier.submit(k) for k in keys[:4]]
    for k, f in zip(keys[:4], futures):
        expert, n, seconds = f.result()
        assert n == sizes[k] and seconds >= 0
        tier.keep(k, expert, n)
        assert tier.cache.resident <= cap
    tier.close()


def test_chunk_ranges_cover_a_record_in_aligned_pieces():
    for nbytes in (ALIGN, 3 * ALIGN, 325 * ALIGN, 1 << 20):
        for chunk in (0, 1, ALIGN, 5 * ALIGN, 64 << 10, 256 << 10, 2 << 20):
            r = chunk_ranges(nbytes, chunk)
            assert r[0][0] == 0 and r[-1][1] == nbytes
            assert all(a[1] == b[0] for a, b in zip(r, r[1:])) and all(s % ALIGN == 0 and e > s for s, e in r)
            if chunk <= 0 or chunk >= nbytes:
                assert r == [(0, nbytes)]
            else:
                assert all(e - s <= -(-chunk // ALIGN) * ALIGN + ALIGN for s, e in r)


def _big_pack(path, n=6):
    """A pack of n int8 records of about 300 KB (many chunks each)."""
    from moebench.engine.quant import quantize
    from moebench.engine.quantized_expert import QuantizedExpert
    g = torch.Generator().manual_seed(1)
    experts = [(0, i, QuantizedExpert(*(quantize(torch.randn(*s, generator=g), "int8")
                                       for s in ((384, 256), (384, 256), (256, 384))))) for i in range(n)]
    write_pack(path, experts)
    return [(0, i) for i in range(n)]


@pytest.mark.parametrize("threads, chunk", [(1, 0), (4, ALIGN), (3, 5 * ALIGN), (8, 64 << 10)])
def test_parallel_reader_reads_the_files_bytes(tmp_path, threads, chunk):
    path = tmp_path / "big.ssd"
    keys = _big_pack(path)
    raw = path.read_bytes()
    tier = DiskTier.open(path, cache_bytes=1 << 30, threads=threads, chunk_bytes=chunk, verify=True)
    try:
        assert tier.pack.read_bytes(keys[0]) > 16 * ALIGN
        guessed = min(2, threads - 1)    # guessed reads in flight are kept below the thread count
        assert all(tier.request(k, guess=True) > 0 for k in keys[:guessed])
        assert tier.request(keys[guessed], guess=True) == 0 if guessed < 2 else True
        for k in keys:                   # every record in flight at once; guessed ones move up the queue
            tier.request(k)
        assert all(not tier._inflight[k].guess for k in keys[:guessed])
        for k in reversed(keys):
            rec, waited = tier.take(k)
            entry = tier.pack.entries[k]
            assert waited >= 0 and bytes(rec.buf.numpy()) == raw[entry["offset"]:entry["offset"] + entry["read_bytes"]]
            assert k in tier.cache
        assert tier.request(keys[0]) == 0              # now a host-RAM cache hit: no read
        st = tier.stats()
        assert st["read_threads"] == threads and st["read_chunk_bytes"] == chunk and st["guess_reads"] == guessed
    finally:
        tier.close()


def test_reader_pool_runs_on_demand_reads_first_and_promotes_a_guess():
    import functools
    import threading
    from moebench.engine.ssd import ReaderPool
    order, gate = [], threading.Event()

    class Owner:
        def __init__(self, name):
            self.name = name

        def run(self, i):
            order.append((self.name, i))
    a, b, c = Owner("a"), Owner("b"), Owner("c")
    pool = ReaderPool(1)
    pool.put([gate.wait])                               # the one thread is busy until the gate opens
    pool.put([functools.partial(a.run, i) for i in range(2)], urgent=False)
    pool.put([functools.partial(c.run, i) for i in range(2)], urgent=False)
    pool.put([functools.partial(b.run, 0)])
    pool.promote(c)                                     # c's guess is asked for on demand
    done = threading.Event()
    pool.put([done.set], urgent=False)                  # queued last: runs after every job above
    gate.set()
    assert done.wait(10)
    assert pool.close() == []
    assert order == [("b", 0), ("c", 0), ("c", 1), ("a", 0), ("a", 1)]


def test_parallel_reader_errors_name_the_file_and_offset(tmp_path, monkeypatch):
    path = tmp_path / "big.ssd"
    keys = _big_pack(path, n=3)
    tier = DiskTier.open(path, threads=4, chunk_bytes=ALIGN, direct=False)
    last = max(tier.pack.entries.values(), key=lambda x: x["offset"])
    with open(path, "r+b") as f:                       # the file shrinks after it was opened
        f.truncate(last["offset"] + 2 * ALIGN)
    key = (last["layer"], last["expert"])
    tier.request(key)
    with pytest.raises(PackError, match=r"big\.ssd: read at \d+ returned 0 bytes") as info:
        tier.take(key)                                 # the first chunk past the end that failed
    at = int(str(info.value).split(" read at ")[1].split()[0])
    assert at % ALIGN == 0 and last["offset"] + 2 * ALIGN <= at < last["offset"] + last["read_bytes"]
    assert not tier.in_flight(key) and key not in tier.cache
    first = min(tier.pack.entries.values(), key=lambda x: x["offset"])
    real = os.preadv

    def failing(fd, bufs, offset):
        if offset == first["offset"] + ALIGN:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, offset)
    monkeypatch.setattr(os, "preadv", failing)
    key = (first["layer"], first["expert"])
    tier.request(key)
    with pytest.raises(PackError, match=rf"big\.ssd: reading layer 0 expert {first['expert']} at "
                                        rf"{first['offset'] + ALIGN} \(\+{ALIGN} bytes\) failed .*Input/output error"):
        tier.take(key)
    monkeypatch.setattr(os, "preadv", real)
    for k in keys[:2]:
        tier.request(k)
    tier.close()                                       # reads still queued are dropped, not waited for


def test_damaged_pack_files_are_refused_with_the_file_named(artifacts, tmp_path):
    split, _, _ = artifacts
    good = (split / "experts.ssd").read_bytes()
    bad = tmp_path / "experts.ssd"

    def refused(data: bytes, match: str, **kw):
        bad.write_bytes(data)
        with pytest.raises(PackError, match=match) as info:
            p = ExpertPack(bad, **kw)
            for k in p.entries:
                p.read(k)
        assert str(bad) in str(info.value)
    refused(b"NOTAPACK" + good[8:], "expected the pack magic")
    refused(good[:len(good) - ALIGN], "truncated")
    refused(good[:20], "shorter than the 32-byte pack header")
    head = struct.unpack("<8sIIQQ", good[:32])
    refused(struct.pack("<8sIIQQ", MAGIC, 7, *head[2:]) + good[32:], "pack version 7; expected 1")
    refused(good[:32] + b"{" * 8 + good[40:], "index is not valid JSON")
    # a flipped byte inside a record: found when reads are verified
    first = min(json.loads(good[32:32 + head[3]])["experts"], key=lambda x: x["offset"])
    flipped = bytearray(good)
    flipped[first["offset"] + 5] ^= 0xFF
    refused(bytes(flipped), "CRC-32 .* the index expects", verify=True)
    # an artifact whose pack does not match its plan
    art = tmp_path / "art"
    shutil.copytree(split, art)
    data = json.loads((art / "plan.json").read_text())
    l, e = first["layer"], first["expert"]
    data["layers"][str(l)]["precision"][e] = "int8"
    (art / "plan.json").write_text(json.dumps(data))
    with pytest.raises(TieringError, match=rf"experts\.ssd: layer {l} expert {e} is .*plan\.json expects 'int8'"):
        Engine.load(art, device="cpu", dtype="float32")
    (art / "experts.ssd").unlink()
    with pytest.raises(TieringError, match=r"experts\.ssd: no pack file"):
        Engine.load(art, device="cpu", dtype="float32")
    with pytest.raises(PackError, match="given twice"):
        x = ExpertPack(split / "experts.ssd")
        k = next(iter(x.entries))
        write_pack(tmp_path / "twice.ssd", [(*k, x.read(k)[0]), (*k, x.read(k)[0])])


def test_greedy_planner_puts_the_coldest_on_disk(stats, ckpt, tmp_path):
    sizes = {f: expert_nbytes(f, H, I) for f in ("int8", "int4", "ternary")}
    n = LAYERS * E
    budgets = Budgets(gpu_bytes=3 * sizes["int8"], host_bytes=4 * sizes["int4"], ssd_bytes=n * sizes["int8"])
    p = plan(stats, ckpt, budgets, ["int8", "int4", "ternary"])
    used = {"gpu": 0, "host": 0, "ssd": 0}
    for precs, homes in zip(p.precision, p.home):
        for fmt, h in zip(precs, homes):
            used[h] += expert_nbytes(fmt, H, I)
    assert used == p.info["bytes"] and used["ssd"] > 0
    assert used["gpu"] <= budgets.gpu_bytes and used["host"] <= budgets.host_bytes and used["ssd"] <= budgets.ssd_bytes
    share = stats.usage_share()
    heat = {h: [float(share[l, e]) for l in range(LAYERS) for e in range(E) if p.home[l][e] == h]
            for h in ("gpu", "host", "ssd")}
    assert min(heat["gpu"]) >= max(heat["host"] + heat["ssd"])
    assert min(heat["host"]) >= max(heat["ssd"])                      # disk holds the coldest
    # without an ssd budget the planner is unchanged: no ssd home, no ssd keys in the file
    old = plan(stats, ckpt, Budgets(budgets.gpu_bytes, n * sizes["int8"]), ["int8", "int4", "ternary"])
    assert not old.has_ssd and "ssd" not in old.info["bytes"] and "ssd_bytes" not in old.info["budgets"]
    old.save(tmp_path / "old.json")
    saved = json.loads((tmp_path / "old.json").read_text())
    assert saved["runtime"] == {"cache_slots": 2, "skip_tail_from": None}
    assert p.ssd_threads == READ_THREADS and p.ssd_chunk_bytes == READ_CHUNK_BYTES
    p.ssd_cache_bytes, p.ssd_threads, p.ssd_chunk_bytes = 12345, 3, 8192
    p.save(tmp_path / "p.json")
    back = Plan.load(tmp_path / "p.json")
    assert back.home == p.home and back.ssd_cache_bytes == 12345 and back.ssd_threads == 3
    assert back.ssd_chunk_bytes == 8192
    data = json.loads((tmp_path / "p.json").read_text())
    data["runtime"]["ssd_cache_bytes"] = -1
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(TieringError, match=r"runtime\.ssd_cache_bytes is -1; expected an integer >= 0"):
        Plan.load(tmp_path / "bad.json")


def test_cli_plan_takes_an_ssd_budget(stats, ckpt, tmp_path):
    from conftest import moebench_cli
    stats.save(tmp_path / "stats.safetensors")
    size = expert_nbytes("int8", H, I)
    proc = moebench_cli("tier", "plan", str(ckpt), str(tmp_path / "stats.safetensors"), "--gpu-bytes", str(4 * size),
                        "--host-bytes", str(4 * size), "--ssd-gib", "0.001", "--ssd-cache-bytes", "65536",
                        "--ladder", "int8,ternary", "--out", str(tmp_path / "plan.json"), check=True)
    assert proc.stdout.strip().splitlines()[-1] == str(tmp_path / "plan.json")
    p = Plan.load(tmp_path / "plan.json")
    assert p.has_ssd and p.ssd_cache_bytes == 65536 and p.info["budgets"]["ssd_bytes"] == round(0.001 * (1 << 30))
    art = moebench_cli("tier", "pack", str(ckpt), str(tmp_path / "plan.json"), "--out", str(tmp_path / "art"), check=True)
    assert (tmp_path / "art" / "experts.ssd").is_file(), art.stdout


@pytest.fixture(scope="module")
def fused_artifacts(ckpt, stats, tmp_path_factory):
    """Hot quarter int8 on the gpu, the rest ternary2 on ssd (no host tier: on CUDA its launch shapes
    differ from HBM's, which would change the rounding): one record layout per layer, so the ssd
    layers run the fused kernels."""
    root = tmp_path_factory.mktemp("ssd_fused")
    record = ALIGN * -(-expert_nbytes("ternary2", H, I) // ALIGN)
    split_plan = plan_hot_cold(stats, 0.25, hot="int8", cold="ternary2", cache_slots=1, ssd_fraction=0.75,
                               ssd_cache_bytes=3 * record)          # three of the ssd records in host RAM
    assert all(h != "host" for row in split_plan.home for h in row)
    res_plan = plan_hot_cold(stats, 0.25, hot="int8", cold="ternary2", cache_slots=1)
    res_plan.home = [["gpu"] * E for _ in range(LAYERS)]
    return pack(ckpt, split_plan, root / "split"), pack(ckpt, res_plan, root / "resident")


@pytest.mark.parametrize("device", ["cuda", "cuda_graphs", "cpu"])
@pytest.mark.parametrize("lookahead", [None, 1, 2])
def test_fused_ssd_path_gives_the_same_logits_with_and_without_guesses(fused_artifacts, batches, lookahead, device):
    """The fused SSD path (device slots filled after a host sync on the routing) decodes exactly
    what the all-resident artifact decodes on the fused kernels, without guesses (None) and with
    guessed reads started one or two layers early; the counters add up. On CUDA (bf16) eagerly and
    as segmented CUDA graphs (cut at each layer's sync), and in Triton's CPU interpreter (float32),
    where triton is installed."""
    graphs = device == "cuda_graphs"
    device = "cuda" if graphs else device
    fused_kernels_or_skip(device)
    split, resident = fused_artifacts
    dtype = "bfloat16" if device == "cuda" else "float32"
    opts = dict(experts_impl="triton")
    if lookahead is not None:
        from moebench.engine.decode_config import DecodeConfig
        opts = dict(decode=DecodeConfig(experts_impl="triton", prefetch_host=True, prefetch_early=True,
                                        ssd_lookahead=lookahead))
    e_ssd = Engine.load(split, device=device, dtype=dtype, cuda_graphs=graphs, **opts)
    e_res = Engine.load(resident, device=device, dtype=dtype, experts_impl="triton")
    mods = find_tiered(e_ssd.model)
    assert all(m._ssd is not None and m.sync_free_tokens() == 0 for m in mods), "every layer on the fused SSD path"
    assert all(m.prefetching == (lookahead is not None) for m in mods)
    assert e_ssd.graph_mode(1) == ("segmented" if graphs else None)
    prompt, new = batches[0][:24], 12
    if graphs:      # a replayed graph calls no Python: compare every step's top log-probs instead
        a, b = (e.generate([prompt], new, ignore_eos=True, top_logprobs=8)[0] for e in (e_ssd, e_res))
        assert e_ssd._graphs, "decode steps ran as segmented CUDA graphs"
        assert a.token_ids == b.token_ids and len(a.top_logprobs) == new
        assert a.top_logprobs == b.top_logprobs
    else:
        a = _logits_of_generate(e_ssd, prompt, new)
        b = _logits_of_generate(e_res, prompt, new)
        assert len(a) == len(b) == new
        for step, (x, y) in enumerate(zip(a, b)):
            assert torch.equal(x, y), f"logits differ at step {step}"
    tel = e_ssd.telemetry()
    routed = (len(prompt) + tel["decode_steps"]) * TOP_K
    for m, layer in zip(mods, tel["tiers"]["layers"]):
        assert layer["routed"] == routed == layer["picks_gpu"] + layer["picks_host"] + layer["picks_ssd"]
        assert layer["ssd_hits"] + layer["ssd_misses"] == layer["picks_ssd"] > 0
        assert layer["ssd_gpu_hits"] <= layer["ssd_hits"] and layer["ssd_guess_hits"] <= layer["ssd_misses"]
        assert layer["bytes_ssd_needed"] <= layer["bytes_ssd_read"]
        assert layer["ssd_guess_reads"] <= layer["ssd_reads"]
        if lookahead is None:
            assert layer["ssd_guess_reads"] == layer["ssd_guess_hits"] == 0
            assert layer["bytes_ssd_needed"] == layer["bytes_ssd_read"]
    layers = tel["tiers"]["layers"]
    if lookahead is not None:       # layer 0 is guessed by no earlier layer; layer 1 from layer 0's attention input
        assert layers[0]["ssd_guess_reads"] == 0
        assert layers[1]["ssd_guess_reads"] > 0
    st = tel["tiers"]["disk"]
    assert st["guess_used"] + st["guess_unused_now"] + st["guess_wasted"] == st["guess_reads"]
    assert st["cache_peak_bytes"] <= st["cache_capacity_bytes"]
    # the per-expert path (prefill) and the fused path share one host-RAM cache: a second prompt
    # starts warm and still matches
    assert torch.equal(e_ssd.logits(batches[1][:20]), e_res.logits(batches[1][:20]))
