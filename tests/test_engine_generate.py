"""Engine generation features: tokenizer, top log-probs, seeded sampling, stops, batching, errors.

The model is a tiny random Qwen3-MoE saved by transformers; the tokenizer is a byte-level BPE
trained here on the real War and Peace text from the dataset mirror.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from test_engine_parity import DEVICES, VOCAB, hf_logits, make_checkpoint, random_ids, require

from moebench.engine import Engine, EngineError

tokenizers = pytest.importorskip("tokenizers")


def train_tokenizer(out: Path, data_dir: Path) -> None:
    text_file = data_dir / "haystack" / "war_and_peace.txt"
    assert text_file.is_file(), f"dataset mirror missing {text_file}"
    text = text_file.read_text(encoding="utf-8")[:200_000]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text[i:i + 2000] for i in range(0, len(text), 2000)], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, data_dir):
    path = tmp_path_factory.mktemp("engine_gen")
    hf = make_checkpoint("qwen3_moe-norm", path, seed=11)
    train_tokenizer(path, data_dir)
    return path, hf


def test_tokenizer_round_trip_on_real_text(ckpt, data_dir):
    path, _ = ckpt
    eng = Engine.load(path, max_seq_len=64)
    line = (data_dir / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()[0]
    question = json.loads(line)["question"]
    ids = eng.tokenize(question)
    assert 0 < len(ids) < len(question.encode()) and max(ids) < VOCAB
    assert eng.detokenize(ids) == question
    assert eng.eos_token_id == eng.tokenizer.token_to_id("<|endoftext|>") == 0


@pytest.mark.parametrize("device", DEVICES)
def test_top_logprobs_are_the_model_distribution(ckpt, device):
    require(device)
    path, hf = ckpt
    eng = Engine.load(path, device=device, max_seq_len=64)
    prompt = random_ids(9, seed=12)
    out = eng.generate([prompt], max_new_tokens=6, top_logprobs=5, ignore_eos=True)[0]
    assert len(out.top_logprobs) == 6 and all(len(step) == 5 for step in out.top_logprobs)
    ref = torch.log_softmax(hf_logits(hf, prompt + out.token_ids, device), dim=-1)
    for i, step in enumerate(out.top_logprobs):
        vals, idx = torch.topk(ref[len(prompt) - 1 + i], 5)
        assert [t for t, _ in step] == idx.tolist()
        assert max(abs(lp - v) for (_, lp), v in zip(step, vals.tolist())) < 1e-4
        assert step[0][0] == out.token_ids[i]          # greedy picks the top token


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_sampling_is_reproducible_and_follows_the_distribution(ckpt, device):
    require(device)
    path, hf = ckpt
    eng = Engine.load(path, device=device, max_seq_len=64)
    prompt = random_ids(7, seed=13)
    a = eng.generate([prompt], max_new_tokens=24, temperature=1.5, seed=123, ignore_eos=True)[0]
    b = eng.generate([prompt], max_new_tokens=24, temperature=1.5, seed=123, ignore_eos=True)[0]
    c = eng.generate([prompt], max_new_tokens=24, temperature=1.5, seed=124, ignore_eos=True)[0]
    greedy = eng.generate([prompt], max_new_tokens=24, ignore_eos=True)[0]
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids and a.token_ids != greedy.token_ids
    # The first sampled token is exactly what torch.multinomial draws from the reference distribution.
    probs = torch.softmax(hf_logits(hf, prompt, device)[-1].to(device) / 1.5, dim=-1)
    g = torch.Generator(device=device).manual_seed(123)
    assert a.token_ids[0] == torch.multinomial(probs[None], 1, generator=g).item()


def test_stop_ids_and_eos_end_generation(ckpt, tmp_path):
    path, _ = ckpt
    eng = Engine.load(path, max_seq_len=64)
    prompt = random_ids(8, seed=14)
    full = eng.generate([prompt], max_new_tokens=20, ignore_eos=True)[0].token_ids
    stop = full[6]
    j = full.index(stop)
    out = eng.generate([prompt], max_new_tokens=20, stop_ids=[stop])[0]
    assert out.token_ids == full[:j] and out.finish_reason == "stop" and out.stop_token == stop
    assert len(out.token_times) == j + 1

    # EOS from the config (no tokenizer here) ends generation; ignore_eos keeps going.
    eos_dir = tmp_path / "eos"
    eos_dir.mkdir()
    cfg = json.loads((path / "config.json").read_text())
    (eos_dir / "config.json").write_text(json.dumps({**cfg, "eos_token_id": full[3]}))
    (eos_dir / "model.safetensors").symlink_to(path / "model.safetensors")
    eng2 = Engine.load(eos_dir, max_seq_len=64)
    assert eng2.tokenizer is None and eng2.eos_token_id == full[3]
    k = full.index(full[3])
    assert eng2.generate([prompt], max_new_tokens=20)[0].token_ids == full[:k]
    assert eng2.generate([prompt], max_new_tokens=20, ignore_eos=True)[0].token_ids == full
    with pytest.raises(EngineError, match="no tokenizer.json"):
        eng2.tokenize("hello")


def test_batches_larger_than_max_batch_and_callbacks(ckpt):
    path, _ = ckpt
    eng = Engine.load(path, max_seq_len=64, max_batch=2)
    prompts = [random_ids(n, seed=20 + n) for n in (3, 10, 6)]
    singles = [eng.generate([p], max_new_tokens=12, ignore_eos=True)[0].token_ids for p in prompts]
    seen: list[tuple[int, int]] = []
    outs = eng.generate(prompts, max_new_tokens=12, ignore_eos=True, on_token=lambda i, t: seen.append((i, t)))
    assert [o.token_ids for o in outs] == singles
    for i, o in enumerate(outs):
        assert [t for j, t in seen if j == i] == o.token_ids
        assert len(o.token_times) == 12 and o.token_times == sorted(o.token_times) and o.token_times[0] > 0
    assert eng.generate(prompts[:1], max_new_tokens=0)[0].token_ids == []


@pytest.mark.parametrize("device", DEVICES)
def test_decoding_one_step_ahead_of_the_host_changes_no_output(ckpt, device):
    """Engine.decode_ahead (on by default on CUDA: step n+1 is queued before the host takes token
    n) gives the same tokens, log-probs, seeded samples, stops and callbacks as step-by-step decode,
    with CUDA graphs too, where the queued step overwrites the graph's logits buffer."""
    require(device)
    path, _ = ckpt
    assert Engine.load(path, device=device, max_seq_len=64).decode_ahead == (device == "cuda")
    prompts = [random_ids(n, seed=40 + n) for n in (5, 11)]
    full = Engine.load(path, device=device, max_seq_len=64).generate(prompts[:1], 16, ignore_eos=True)[0].token_ids
    stop = full[5]

    def run(ahead: bool, graphs: bool) -> list:
        eng = Engine.load(path, device=device, max_seq_len=64, max_batch=2, cuda_graphs=graphs)
        eng.decode_ahead = ahead
        seen: list[tuple[int, int]] = []
        outs = [eng.generate(prompts, 16, ignore_eos=True, top_logprobs=3, on_token=lambda i, t: seen.append((i, t))),
                eng.generate(prompts, 16, temperature=1.2, seed=7, ignore_eos=True),
                eng.generate(prompts[:1], 16, stop_ids=[stop]),
                eng.generate(prompts[:1], 1, ignore_eos=True)]
        return [[(o.token_ids, o.finish_reason, o.stop_token, len(o.token_times),
                  [[t for t, _ in step] for step in o.top_logprobs]) for o in batch] for batch in outs] + [seen]

    for graphs in (False, True) if device == "cuda" else (False,):
        base = run(False, graphs)
        assert base[2][0][0] == full[:full.index(stop)] and base[2][0][1] == "stop"
        assert base[3][0][0] == full[:1] and base[3][0][3] == 1
        assert run(True, graphs) == base, graphs


def trace_decode_order(eng: Engine) -> list:
    """Record, in order, each decode step the engine queues (with whether its graph existed then)
    and each token the host reads (on_token): the events list, filled as eng generates."""
    events: list = []
    decode = eng._decode

    def spy(tokens, positions, kv_len, batch=None, first_position=None):
        B = tokens.shape[0] if tokens is not None else batch
        events.append(("step", (B, kv_len) in eng._graphs or eng.graph_mode(B) is None))
        return decode(tokens, positions, kv_len, batch=batch, first_position=first_position)
    eng._decode = spy
    return events


def test_a_step_whose_graph_is_new_is_queued_after_the_token_before_is_read(ckpt, monkeypatch):
    """decode_ahead queues step n+1 before the host reads token n, except where step n+1 must first
    capture its CUDA graph (on the host): then token n, the first token after a prefill, is read
    first, and its time does not hold the capture. Here (CPU) the first step's graph is made to be
    missing; every later step is queued ahead, and the tokens are the same as without."""
    path, _ = ckpt
    eng = Engine.load(path, max_seq_len=64)
    prompt = random_ids(7, seed=5)
    plain = eng.generate([prompt], 5, ignore_eos=True)[0].token_ids
    eng.decode_ahead = True
    first_kv = eng._kv_len(len(prompt) + 1)
    asked = []
    monkeypatch.setattr(eng, "_graph_ready", lambda B, kv_len: asked.append(kv_len) or len(asked) > 1)
    events = trace_decode_order(eng)
    out = eng.generate([prompt], 5, ignore_eos=True, on_token=lambda i, t: events.append(("token", t)))
    assert out[0].token_ids == plain and asked[0] == first_kv
    assert [e[0] for e in events] == ["token", "step", "step", "token", "step", "token", "step", "token", "token"]


@pytest.mark.gpu
def test_cuda_graph_capture_waits_for_the_first_token(ckpt):
    """With CUDA graphs and decode_ahead, every step that captures a new graph (the first step of a
    new KV bucket) is queued only after the host has read the token before it; steps whose graph
    exists are queued ahead of it. The tokens are those of eager decode."""
    require("cuda")
    path, _ = ckpt
    eager = Engine.load(path, device="cuda", max_seq_len=600, experts_impl="triton")
    eng = Engine.load(path, device="cuda", max_seq_len=600, experts_impl="triton", cuda_graphs=True)
    assert eng.decode_ahead
    prompt = random_ids(250, seed=30)              # 250 + 20 tokens: buckets 256 and 512
    events = trace_decode_order(eng)
    out = eng.generate([prompt], 20, ignore_eos=True, on_token=lambda i, t: events.append(("token", t)))
    assert out[0].token_ids == eager.generate([prompt], 20, ignore_eos=True)[0].token_ids
    # step k (it computes token k + 1) is queued after k tokens were read (ahead of token k), or,
    # where it captures a graph, after k + 1
    read, lags = 0, []
    for kind, graph_existed in events:
        if kind == "token":
            read += 1
        else:
            lags.append((graph_existed, read - len(lags)))
    assert lags == [(False, 1)] + [(True, 0)] * 5 + [(False, 1)] + [(True, 0)] * 12, lags
    assert len(eng._graphs) == 2


def test_bad_requests_are_refused_with_clear_errors(ckpt):
    path, _ = ckpt
    eng = Engine.load(path, max_seq_len=32)
    with pytest.raises(EngineError, match=r"prompts\[0\]: 30 prompt tokens \+ 5 new tokens exceed max_seq_len 32"):
        eng.generate([list(range(30))], max_new_tokens=5)
    with pytest.raises(EngineError, match=r"prompts\[1\]\[2\] = 999: expected a token id in \[0, 320\)"):
        eng.generate([[1, 2], [1, 2, 999]], max_new_tokens=2)
    with pytest.raises(EngineError, match=r"prompts\[0\] is empty"):
        eng.generate([[]], max_new_tokens=2)
    with pytest.raises(EngineError, match="exceeds max_seq_len 32"):
        eng.logits(list(range(33)))
    # numpy / tensor integers are accepted as token ids
    assert eng.logits(torch.tensor([1, 2, 3])).shape == (3, VOCAB)


@pytest.mark.gpu
def test_cuda_graph_decode_matches_eager(ckpt):
    """The opt-in CUDA-graph decode gives the same tokens and log-probs, across KV buckets (256)."""
    require("cuda")
    path, _ = ckpt
    eager = Engine.load(path, device="cuda", max_seq_len=600, max_batch=2)
    graphed = Engine.load(path, device="cuda", max_seq_len=600, max_batch=2, cuda_graphs=True)
    assert graphed.cuda_graphs and graphed._graph_batch_limit() >= 2
    prompts = [random_ids(250, seed=30), random_ids(40, seed=31)]
    a = eager.generate(prompts, max_new_tokens=20, ignore_eos=True, top_logprobs=3)
    b = graphed.generate(prompts, max_new_tokens=20, ignore_eos=True, top_logprobs=3)
    assert len(graphed._graphs) == 2           # kv_len 256 and 512
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for oa, ob in zip(a, b):
        for sa, sb in zip(oa.top_logprobs, ob.top_logprobs):
            assert [t for t, _ in sa] == [t for t, _ in sb]
            assert max(abs(x - y) for (_, x), (_, y) in zip(sa, sb)) < 1e-4
    c = graphed.generate(prompts[1:], max_new_tokens=20, ignore_eos=True)   # batch 1: a new graph
    assert c[0].token_ids == a[1].token_ids
    # The fused path at batch 1: the graph folds its greedy pick into the lm_head GEMV and feeds the
    # next step (the bucket's second graph is captured between two fed steps); sampled steps copy in.
    f_eager = Engine.load(path, device="cuda", max_seq_len=600, experts_impl="triton")
    f_graph = Engine.load(path, device="cuda", max_seq_len=600, experts_impl="triton", cuda_graphs=True)
    for kw in ({}, {"temperature": 1.0, "seed": 3}):
        fe = f_eager.generate(prompts[:1], max_new_tokens=20, ignore_eos=True, **kw)[0].token_ids
        fg = f_graph.generate(prompts[:1], max_new_tokens=20, ignore_eos=True, **kw)[0].token_ids
        assert fe == fg and len(fe) == 20, kw
    assert len(f_graph._graphs) == 2 and all(g.keys is not None for g in f_graph._graphs.values())
    # grouped_mm has no host sync at any batch size: graphs are used for it too, same numbers as eager.
    g_eager = Engine.load(path, device="cuda", dtype="bfloat16", max_seq_len=600, max_batch=2,
                          experts_impl="grouped_mm")
    g_graph = Engine.load(path, device="cuda", dtype="bfloat16", max_seq_len=600, max_batch=2,
                          experts_impl="grouped_mm", cuda_graphs=True)
    assert g_graph._graph_batch_limit() > 2
    ge = g_eager.generate(prompts, max_new_tokens=20, ignore_eos=True, top_logprobs=3)
    gg = g_graph.generate(prompts, max_new_tokens=20, ignore_eos=True, top_logprobs=3)
    assert len(g_graph._graphs) == 2
    assert [o.token_ids for o in ge] == [o.token_ids for o in gg]
