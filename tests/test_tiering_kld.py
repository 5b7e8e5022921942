"""On the trained zoo model, the tiered candidate with cold experts ternary drifts further from BF16
(mean KLD, teacher-forced on WikiText-2) than the same plan with cold experts int8."""
from __future__ import annotations

import numpy as np
import torch

from moebench.datasets import data_dir, read_text
from moebench.demo import calibrate_zoo, pack_tiered
from moebench.engine import Engine
from moebench.kld.stats import full_kld


def _mean_kld(base_logits: torch.Tensor, cand: Engine, ids: list[int]) -> float:
    base_logp = torch.log_softmax(base_logits.double(), -1).numpy()
    cand_logits = cand.logits(ids).double().numpy()
    half = len(ids) // 2           # score the second half of the window, as llama-perplexity does
    ts = full_kld(base_logp[half:-1], cand_logits[half:-1], np.asarray(ids[half + 1:]))
    return float(np.mean(ts.kld))


def test_ternary_cold_experts_drift_more_than_int8(zoo, tmp_path):
    ckpt = zoo / "tiny-moe"
    base = Engine.load(ckpt, device="cpu", dtype="float32")
    text = read_text(data_dir() / "wikitext2" / "wiki.test.raw")
    ids = base.tokenize(text[:20000])[:512]
    base_logits = base.logits(ids)
    kld = {}
    stats = calibrate_zoo(ckpt, n_tokens=4096)
    for cold in ("int8", "ternary"):
        art = pack_tiered(ckpt, tmp_path / cold, hot="int8", cold=cold, log=lambda *_: None, stats=stats)
        kld[cold] = _mean_kld(base_logits, Engine.load(art, device="cpu", dtype="float32"), ids)
    print(f"mean KLD vs BF16 over {len(ids) // 2 - 1} WikiText tokens: cold int8 {kld['int8']:.6f}, "
          f"cold ternary {kld['ternary']:.6f}")
    assert 0 < kld["int8"] < kld["ternary"], kld
    assert kld["ternary"] > 1e-3, kld
