"""The tiny MoE zoo: one set of trained weights, loaded by transformers and by a real llama-server.

The zoo is built once per module into a temp folder from the committed weights (a conversion and two
quantizations). Skips only when the llama.cpp binaries or source tree are absent.
"""
from __future__ import annotations

import gzip
import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from moebench.datasets import data_dir, read_csv_rows, read_text

CTX = 1024


def _llamacpp_or_skip() -> Path:
    from moebench.tools import llamacpp

    try:
        llamacpp.tool("llama-server"), llamacpp.tool("llama-quantize")
    except llamacpp.ToolError as e:
        pytest.skip(f"llama.cpp binaries absent ({e})")
    for cuda in (False, True):
        src = llamacpp.variant_dir(cuda) / "src" / "llama.cpp"
        if (src / "convert_hf_to_gguf.py").is_file():
            return src
    pytest.skip("llama.cpp source tree absent (run `moebench tools build-llamacpp`)")


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    _llamacpp_or_skip()
    from moebench.zoo.build import build_zoo

    return build_zoo(tmp_path_factory.mktemp("zoo") / "zoo")


@pytest.fixture(scope="module")
def hf_tokenizer(zoo):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(zoo["paths"]["hf_dir"])


@pytest.fixture(scope="module")
def hf_model(zoo):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(zoo["paths"]["hf_dir"], dtype=torch.float32)
    return model.eval()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(zoo):
    """A real llama-server on the BF16 GGUF, on a free 127.0.0.1 port; killed at the end."""
    import httpx

    from moebench.tools import llamacpp

    port = _free_port()
    log = Path(zoo["paths"]["out_dir"]) / "llama-server.log"
    cmd = [str(llamacpp.tool("llama-server")), "-m", zoo["paths"]["bf16"], "--host", "127.0.0.1",
           "--port", str(port), "-c", str(CTX), "-t", "2", "-np", "1"]
    with log.open("wb") as log_f:
        proc = subprocess.Popen(cmd, stdout=log_f, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"llama-server not healthy after 120 s:\n{log.read_text()[-3000:]}")
            time.sleep(0.3)
        with httpx.Client(base_url=base, timeout=60) as client:
            yield client
    finally:
        proc.kill()
        proc.wait(timeout=30)


def _english() -> str:
    text = read_text(data_dir() / "haystack" / "war_and_peace.txt")
    start = text.index("CHAPTER I")
    return text[start:start + 1500]


def _chinese() -> str:
    rows = read_csv_rows(data_dir() / "cmmlu" / "test" / "anatomy.csv", ("Question", "A", "B", "C", "D"))
    return "\n".join(f"{r['Question']}\nA. {r['A']}\nB. {r['B']}\nC. {r['C']}\nD. {r['D']}\n答案：" for r in rows[:4])


def _code() -> str:
    with gzip.open(data_dir() / "humaneval" / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return rows[0]["prompt"] + rows[0]["canonical_solution"] + "\n" + rows[2]["prompt"]


def _wikitext() -> str:
    text = read_text(data_dir() / "wikitext2" / "wiki.test.raw")
    return text[2000:3000]


def test_hf_checkpoint_loads_as_qwen3_moe(zoo, hf_model):
    import torch

    cfg = hf_model.config
    assert type(hf_model).__name__ == "Qwen3MoeForCausalLM"
    assert cfg.norm_topk_prob is True and cfg.num_experts == 8 and cfg.num_experts_per_tok == 2
    # zoo.json records the hash of every file of the HF folder as it is on disk
    from moebench.datasets import sha256_file

    hf_dir = Path(zoo["paths"]["hf_dir"])
    assert zoo["hf_files"] and all(sha256_file(hf_dir / n) == h for n, h in zoo["hf_files"].items())
    on_disk = json.loads(Path(zoo["paths"]["zoo_json"]).read_text())
    assert on_disk["gguf"]["q4_0"]["sha256"] == sha256_file(Path(zoo["paths"]["q4_0"]))
    # trained, not random: the next-token distribution is peaked (random init gives max p ~ 1/50257)
    with torch.no_grad():
        probs = hf_model(torch.tensor([[464, 1893, 286]])).logits[0, -1].softmax(-1)
    assert probs.max().item() > 0.05


def test_gguf_files_are_qwen3moe_with_block_aligned_matrices(zoo):
    from moebench.gguf_header import read_gguf

    for kind, want in (("bf16", "BF16"), ("q8_0", "Q8_0"), ("q4_0", "Q4_0")):
        g = read_gguf(Path(zoo["paths"][kind]))
        assert g.metadata["general.architecture"] == "qwen3moe"
        assert g.metadata["tokenizer.ggml.pre"] == "gpt-2"
        assert g.metadata["qwen3moe.expert_count"] == 8
        matrices = [t for t in g.tensors if len(t.shape) >= 2]
        assert all(t.shape[0] % 32 == 0 for t in matrices), [(t.name, t.shape) for t in matrices]
        quantizable = [t for t in matrices if "ffn_gate_inp" not in t.name]
        assert {t.type_name for t in quantizable} == {want}, kind
        assert any("ffn_up_exps" in t.name for t in g.tensors)


def test_rebuild_reuses_outputs(zoo):
    from moebench.zoo.build import build_zoo

    paths = zoo["paths"]
    before = {k: Path(paths[k]).stat().st_mtime_ns for k in ("bf16", "q8_0", "q4_0")}
    again = build_zoo(paths["out_dir"])
    assert {k: Path(paths[k]).stat().st_mtime_ns for k in before} == before
    assert again["gguf"] == zoo["gguf"]


def test_missing_weights_error_names_the_folder(tmp_path):
    from moebench.zoo.build import ZooBuildError, read_weights

    with pytest.raises(ZooBuildError, match=str(tmp_path)):
        read_weights(tmp_path)


def test_committed_tokenizer_is_the_one_rebuilt_from_llamacpps_vocabulary(tmp_path):
    """The HF checkpoint's tokenizer comes from weights/tokenizer.json.gz (no llama.cpp needed for the
    engine's zoo); it must be byte for byte what llama.cpp's ggml-vocab-gpt-2.gguf rebuilds."""
    from moebench.zoo.tokenizer import write_committed_tokenizer, write_hf_tokenizer

    rebuilt = write_hf_tokenizer(tmp_path / "rebuilt", _llamacpp_or_skip())
    committed = write_committed_tokenizer(tmp_path / "committed")
    assert [p.name for p in rebuilt] == [p.name for p in committed]
    for a, b in zip(rebuilt, committed):
        assert a.read_bytes() == b.read_bytes(), a.name


def test_hf_only_build_needs_no_llamacpp(tmp_path, monkeypatch):
    from moebench.datasets import sha256_file
    from moebench.zoo.build import WEIGHTS_DIR, build_zoo

    monkeypatch.setenv("MOEBENCH_CACHE", str(tmp_path / "empty-cache"))
    info = build_zoo(tmp_path / "zoo", gguf=False, log=lambda m: None)
    assert not (tmp_path / "empty-cache").exists()            # no llama.cpp download or build
    hf = Path(info["paths"]["hf_dir"])
    assert sorted(p.name for p in hf.iterdir()) == sorted(info["hf_files"]) and info["gguf"] == {}
    assert info["hf_files"]["model.safetensors"] == sha256_file(WEIGHTS_DIR / "model.safetensors")


def test_hf_tokenizer_passes_llamacpp_gpt2_vocab_tests(zoo, hf_tokenizer):
    """llama.cpp ships expected ids for its vocab tests (models/ggml-vocab-gpt-2.gguf.inp/.out)."""
    src = _llamacpp_or_skip()
    inp = (src / "models" / "ggml-vocab-gpt-2.gguf.inp").read_text(encoding="utf-8")
    out = (src / "models" / "ggml-vocab-gpt-2.gguf.out").read_text(encoding="utf-8").split("\n")
    cases = inp.split("\n__ggml_vocab_test__\n")
    assert len(cases) > 30
    for text, ids in zip(cases, out):
        assert hf_tokenizer.encode(text, add_special_tokens=False) == [int(x) for x in ids.split()], repr(text)


@pytest.mark.parametrize("sample", [_english, _chinese, _code])
def test_tokenization_identical_through_llama_server(server, hf_tokenizer, sample):
    text = sample()
    got = server.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    want = hf_tokenizer.encode(text)
    assert len(want) > 100
    assert got == want


def test_next_token_topk_agrees_between_transformers_and_llama_server(server, hf_tokenizer, hf_model):
    """Two independent implementations of the same weights predict the same next tokens."""
    import torch

    prompts = []
    for sample in (_english, _wikitext, _code, _chinese):
        ids = hf_tokenizer.encode(sample())
        prompts += [ids[:40], ids[:200]]
    top1_same, overlaps, logprob_gaps = 0, [], []
    for ids in prompts:
        resp = server.post("/completion", json={"prompt": ids, "n_predict": 1, "n_probs": 10, "temperature": 0,
                                                "cache_prompt": False}).json()
        server_top = resp["completion_probabilities"][0]["top_logprobs"]
        server_ids = [p["id"] for p in server_top]
        with torch.no_grad():
            logprobs = hf_model(torch.tensor([ids])).logits[0, -1].log_softmax(-1)
        hf_top = logprobs.topk(10).indices.tolist()
        top1_same += server_ids[0] == hf_top[0]
        overlaps.append(len(set(server_ids) & set(hf_top)))
        logprob_gaps.append(abs(server_top[0]["logprob"] - logprobs[server_ids[0]].item()))
    # llama.cpp rounds activations to bf16 in its BF16 matmuls, transformers here runs fp32 on the
    # same bf16 weights: seen here, top-10 sets identical and top-1 log-probs within 0.005. A real
    # mismatch is much larger: the same check with norm_topk_prob=False on the HF side kept every
    # argmax but moved top-1 log-probs by up to 0.68 and top-10 overlap down to 8.
    assert top1_same == len(prompts), (top1_same, overlaps)
    assert min(overlaps) >= 9, overlaps
    assert max(logprob_gaps) < 0.03, logprob_gaps


def test_model_is_informative_by_llamacpp_figures(zoo):
    """The point of training: WikiText perplexity far below the vocabulary, Q4_0 measurably off BF16,
    experts unevenly loaded (measured 6,126 / 0.0065 / 0.62 for the committed weights)."""
    from moebench.zoo.figures import measure_zoo

    fig = measure_zoo(Path(zoo["paths"]["out_dir"]), chunks=4, skew_seqs=4)   # smaller than the doc's run
    assert fig["bf16"]["ppl"] < 50257 / 5
    assert fig["q4_0"]["mean_kld"] >= 1e-3
    assert fig["q8_0"]["mean_kld"] < fig["q4_0"]["mean_kld"]
    assert fig["expert_load_training_text"]["busiest_25pct_share_mean"] > 0.4
