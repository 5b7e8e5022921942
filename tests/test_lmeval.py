"""lm-eval interoperability: the runner adapter, run_lm_eval into a moebench run, the samples importer
and compare over imported runs. Real lm-eval 0.4.13, real data from the mirror, the deterministic
MarkovRunner of test_serve.py (a real BPE tokenizer; exact log-probs)."""
from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from moebench.lmeval.adapter import AdapterOptions, LoopThread, RunnerLM, evaluate_runner
from moebench.lmeval.importer import SamplesError, import_lm_eval
from moebench.lmeval.local_tasks import materialize, shipped_task_names
from moebench.runners.base import Capability, GenerateRequest
from moebench.store import load_run
from test_serve import MarkovRunner

TOP_ONLY = MarkovRunner.ALL - {Capability.FULL_LOGITS}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


class Req:
    """The part of lm_eval.api.instance.Instance the adapter reads."""

    def __init__(self, *args):
        self.args = args


def test_materialize_points_at_the_mirror(tmp_path, data_dir):
    inc = materialize(tmp_path / "inc", data_dir)
    gsm = (inc / "gsm8k.yaml").read_text(encoding="utf-8")
    assert f'"{data_dir.resolve()}/gsm8k/test.jsonl"' in gsm and "@DATA_DIR@" not in gsm
    subjects = sorted(p.stem for p in (data_dir / "cmmlu" / "test").glob("*.csv"))
    assert len(subjects) == 67
    assert len(list((inc / "cmmlu").glob("cmmlu_*.yaml"))) == 67
    anatomy = (inc / "cmmlu" / "cmmlu_anatomy.yaml").read_text(encoding="utf-8")
    assert "解剖学" in anatomy and str(data_dir.resolve() / "cmmlu" / "dev" / "anatomy.csv") in anatomy
    assert {"gsm8k", "cmmlu", "cmmlu_anatomy"} <= shipped_task_names(data_dir)
    with pytest.raises(FileNotFoundError, match="neither gsm8k"):
        materialize(tmp_path / "inc2", tmp_path / "empty-mirror")


def _lm(caps=None, **opts) -> tuple[RunnerLM, LoopThread]:
    loop = LoopThread()
    return RunnerLM(MarkovRunner(caps=caps), loop, AdapterOptions(**opts)), loop


def test_loglikelihood_top_logprobs_path_equals_full_logits_path():
    reqs = [Req("Question: How many apples?\nAnswer:", " 12"),
            Req("女性生殖腺是\nA. 卵巢\n答案：", " A"),
            Req("Janet has 3 ducks ", "and 4 cats")]          # trailing space moves to the continuation
    exact, l1 = _lm()
    by_top, l2 = _lm(caps=TOP_ONLY, top_n=exact.runner.vocab)
    try:
        assert exact.scoring == "full_logits" and by_top.scoring == "top_logprobs"
        a, b = exact.loglikelihood(reqs), by_top.loglikelihood(reqs)
        for (lp_a, g_a), (lp_b, g_b) in zip(a, b):
            assert lp_a == pytest.approx(lp_b, abs=1e-9) and g_a == g_b
        # Independent check of the first request from the model's table.
        ctx = exact.runner.tok.encode("Question: How many apples?\nAnswer:", add_special_tokens=False).ids
        whole = exact.runner.tok.encode("Question: How many apples?\nAnswer: 12", add_special_tokens=False).ids
        cont = whole[len(ctx):]
        seq = ctx + cont
        want = sum(exact.runner._logprobs_after(seq[i - 1])[seq[i]] for i in range(len(ctx), len(seq)))
        assert a[0][0] == pytest.approx(float(want), abs=1e-9)
        assert by_top.stats["floored_tokens"] == 0
    finally:
        l1.stop()
        l2.stop()


def test_loglikelihood_floor_and_error_for_tokens_outside_top_n():
    req = [Req("Question: How many apples?\nAnswer:", " seventeen thousand")]
    floor_lm, l1 = _lm(caps=TOP_ONLY, top_n=2)
    err_lm, l2 = _lm(caps=TOP_ONLY, top_n=2, missing="error")
    exact, l3 = _lm()
    try:
        (lp_floor, greedy), = floor_lm.loglikelihood(req)
        (lp_exact, _), = exact.loglikelihood(req)
        assert floor_lm.stats["floored_tokens"] >= 1 and not greedy
        assert floor_lm.floored_contexts[req[0].args[0]] == floor_lm.stats["floored_tokens"]
        assert lp_floor >= lp_exact          # the floor is an upper bound of each missing token's log-prob
        (lp_err, _), = err_lm.loglikelihood(req)
        assert lp_err == float("-inf")
        assert "not among the top 2" in err_lm.failed_contexts[req[0].args[0]]
    finally:
        for loop in (l1, l2, l3):
            loop.stop()


def test_generate_until_cuts_at_stop_and_matches_runner():
    lm, loop = _lm()
    try:
        ctx = "Question: Tom has 5 pens and buys 3 more. How many pens?\nAnswer:"
        full = asyncio.run(lm.runner.generate(GenerateRequest(prompt=ctx, max_tokens=40)))
        stop = full.text[5:8]
        out = lm.generate_until([Req(ctx, {"until": [stop], "max_gen_toks": 40, "do_sample": False})])
        assert out == [full.text[: full.text.index(stop)]]
    finally:
        loop.stop()


def _choice_logprob(runner: MarkovRunner, context: str, letter: str) -> float:
    ctx = runner.tok.encode(context, add_special_tokens=False).ids
    whole = runner.tok.encode(context + " " + letter, add_special_tokens=False).ids
    seq = ctx + whole[len(ctx):]
    return float(sum(runner._logprobs_after(seq[i - 1])[seq[i]] for i in range(len(ctx), len(seq))))


def test_run_lm_eval_cmmlu_records_over_top_logprobs_runner(tmp_path, data_dir):
    runner = MarkovRunner(caps=TOP_ONLY)
    out = evaluate_runner(runner, ["cmmlu_anatomy"], 5, tmp_path / "run", options=AdapterOptions(top_n=1200))
    manifest, records = load_run(out)
    assert manifest["status"] == "complete" and manifest["adapter_stats"]["scoring"] == "top_logprobs"
    # Four single-token choices share one context: one request per question.
    assert manifest["adapter_stats"]["requests"] == 5
    assert [r["item_id"] for r in records] == [f"cmmlu_anatomy/{i}" for i in range(5)]
    def csv_rows(path: Path) -> list[list[str]]:
        with path.open(encoding="utf-8", newline="") as f:
            return list(csv.reader(f))[1:6]

    rows = csv_rows(data_dir / "cmmlu" / "test" / "anatomy.csv")
    shots = "".join(f"{q.strip()}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\n答案： {ans}\n\n"
                    for _, q, a, b, c, d, ans in csv_rows(data_dir / "cmmlu" / "dev" / "anatomy.csv"))
    desc = "以下是关于解剖学的单项选择题，请直接给出正确答案的选项。\n\n"
    for rec, (_, q, a, b, c, d, ans) in zip(records, rows):
        context = desc + shots + f"{q.strip()}\nA. {a}\nB. {b}\nC. {c}\nD. {d}\n答案："
        assert rec["prompt_hash"] == sha(context)           # 5-shot from dev, upstream's format
        lps = [_choice_logprob(runner, context, x) for x in "ABCD"]
        assert rec["choice_logprobs"] == pytest.approx(lps, abs=1e-9)
        assert rec["answer"] == "ABCD"[int(np.argmax(lps))] and rec["reference"] == ans
        assert rec["correct"] == (rec["answer"] == ans) and rec["status"] == "ok"
        assert rec["task"] == "cmmlu_anatomy"


def test_run_lm_eval_gsm8k_filters_errors_and_prompts(tmp_path, data_dir):
    test_rows = [json.loads(l) for l in (data_dir / "gsm8k" / "test.jsonl").read_text().splitlines()[:3]]
    runner = MarkovRunner(fail_on=test_rows[1]["question"][:40])   # doc 1's request fails
    out = evaluate_runner(runner, ["gsm8k"], 3, tmp_path / "run")
    manifest, records = load_run(out)
    assert manifest["status"] == "complete" and manifest["adapter_stats"]["errors"] == 1
    # strict-match scores as moebench's gsm8k does: it takes the native name (and item ids)
    assert {r["task"] for r in records} == {"gsm8k", "gsm8k:flexible-extract"}
    assert {r["item_id"] for r in records} == {f"gsm8k/test/{i}" for i in range(3)}
    train = [json.loads(l) for l in (data_dir / "gsm8k" / "train.jsonl").read_text().splitlines()[:5]]
    shots = "".join(f"Question: {t['question']}\nAnswer: {t['answer']}\n\n" for t in train)
    for rec in records:
        doc = int(rec["item_id"].split("/")[-1])
        prompt = shots + f"Question: {test_rows[doc]['question']}\nAnswer:"
        assert rec["prompt_hash"] == sha(prompt)
        if doc == 1:
            assert rec["status"] == "error" and rec["correct"] is None and "planted failure" in rec["error"]
            continue
        want = asyncio.run(runner.generate(GenerateRequest(prompt=prompt, max_tokens=256,
                                                           stop=["Question:", "</s>", "<|im_end|>"]))).text
        assert rec["output"] == want and rec["status"] == "ok"
        assert rec["correct"] is False and rec["reference"] == test_rows[doc]["answer"]
    assert (out / "lm_eval_tasks" / "gsm8k.yaml").is_file() and (out / "lm_eval_results.json").is_file()


# -- importer + compare -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def samples_files(tmp_path_factory, data_dir):
    """Genuine lm-eval samples files, written by lm-eval's own EvaluationTracker."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker
    from lm_eval.tasks import TaskManager

    d = tmp_path_factory.mktemp("lmeval")
    lm, loop = _lm(caps=TOP_ONLY, top_n=1200)
    try:
        tm = TaskManager(include_path=str(materialize(d / "inc", data_dir)), include_defaults=False)
        res = lm_eval.simple_evaluate(model=lm, tasks=["gsm8k", "cmmlu_anatomy"], limit=6, task_manager=tm)
    finally:
        loop.stop()
    samples = res.pop("samples")
    tracker = EvaluationTracker(output_path=str(d / "out"))       # as lm-eval's CLI saves them
    tracker.save_results_aggregated(results=res, samples=samples)
    for task, rows in samples.items():
        tracker.save_results_samples(task_name=task, samples=rows)
    files = sorted((d / "out").rglob("samples_*.jsonl"))
    assert len(files) == 2
    return files


def _rewrite(path: Path, dest: Path, change) -> Path:
    rows = [json.loads(l) for l in path.read_text(encoding="utf-8").splitlines()]
    for r in rows:
        change(r)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return dest


def test_import_two_logs_and_compare_reports_planted_flips(samples_files, tmp_path):
    from moebench.api import compare

    gsm, cmmlu = sorted(samples_files, key=lambda p: "cmmlu" in p.name)

    def plant(side: str):
        def change(r):
            d, f = r["doc_id"], r["filter"]
            if "exact_match" in r and f == "strict-match" and d == 0:
                r["exact_match"] = 0.0 if side == "base" else 1.0           # a win
            if "acc" in r and d == 1:
                r["acc"] = 0.0 if side == "base" else 1.0                   # a win
            if "acc" in r and d == 2:
                r["acc"] = 1.0 if side == "base" else 0.0                   # a loss
            if "acc" in r and d == 3 and side == "cand":
                r["prompt_hash"] = "0" * 64                                 # a different question
        return change

    base = [_rewrite(p, tmp_path / "base" / p.name, plant("base")) for p in (gsm, cmmlu)]
    cand = [_rewrite(p, tmp_path / "cand" / p.name, plant("cand")) for p in (gsm, cmmlu)]
    bdir, cdir = import_lm_eval(base, tmp_path / "run_base"), import_lm_eval(cand, tmp_path / "run_cand")
    manifest, records = load_run(bdir)
    assert manifest["status"] == "complete" and len(records) == 6 * 2 + 6
    rec = next(r for r in records if r["item_id"] == "gsm8k/test/0" and r["task"] == "gsm8k")
    assert rec["prompt_hash"] and rec["output"] and rec["reference"].split("#### ")[-1] == "18"

    _, cmp = compare(str(bdir), str(cdir), str(tmp_path / "cmp"), write_report=False)
    t = cmp["tasks"]
    assert t["gsm8k"]["wins"] == ["gsm8k/test/0"] and t["gsm8k"]["losses"] == []
    assert t["gsm8k:flexible-extract"]["wins"] == [] and t["gsm8k:flexible-extract"]["losses"] == []
    assert t["cmmlu_anatomy"]["wins"] == ["cmmlu_anatomy/1"]
    assert t["cmmlu_anatomy"]["losses"] == ["cmmlu_anatomy/2"]
    assert t["cmmlu_anatomy"]["excluded"] == ["cmmlu_anatomy/3"] and t["cmmlu_anatomy"]["n_paired"] == 5


def test_import_rejects_bad_files(samples_files, tmp_path):
    bad_name = tmp_path / "results.jsonl"
    shutil.copy(samples_files[0], bad_name)
    with pytest.raises(SamplesError, match="samples_<task>_"):
        import_lm_eval([bad_name], tmp_path / "r1")
    broken = tmp_path / samples_files[0].name
    text = samples_files[0].read_text(encoding="utf-8")
    broken.write_text(text + "{torn\n", encoding="utf-8")
    with pytest.raises(SamplesError, match=rf"line {len(text.splitlines()) + 1} is not valid JSON"):
        import_lm_eval([broken], tmp_path / "r2")
    with pytest.raises(SamplesError, match="appears twice"):
        import_lm_eval([samples_files[0], samples_files[0]], tmp_path / "r3")



# -- integration: real servers ------------------------------------------------------------------

REPO = Path(__file__).resolve().parent.parent
ZOO_HF = REPO / "models" / "zoo" / "tiny-moe"
GSM_LIMIT = 3


@pytest.fixture(scope="module")
def llama_profile(tmp_path_factory) -> Path:
    """A llama-server runner profile over the zoo GGUF (or the llama-server tests' tiny random MoE)."""
    from test_llama_server_runner import _server_binary, _write_tiny_moe
    _server_binary()                                  # skips without the llama.cpp tools
    d = tmp_path_factory.mktemp("llama")
    gguf = next((REPO / "models" / "zoo" / n for n in ("tiny-moe-q8_0.gguf", "tiny-moe-bf16.gguf")
                 if (REPO / "models" / "zoo" / n).is_file()), None) or _write_tiny_moe(d / "tiny-moe-test-f32.gguf")
    prof = d / "llama.toml"
    # One slot with the whole context (5-shot CMMLU prompts are long); one thread: the CPU is shared.
    prof.write_text(f'kind = "llama-server"\nmodel = "{gguf}"\nconcurrency = 1\nctx_size = 4096\n'
                    f'args = ["--threads", "1"]\nstartup_timeout_s = 120.0\n', encoding="utf-8")
    return prof


def _make(profile: Path):
    from moebench.config import load_runner
    from moebench.runners import make_runner, runner_schemas
    return make_runner(load_runner(profile, runner_schemas()))


def _lm_eval_gsm8k(url: str, data_dir: Path, tmp: Path) -> dict[int, dict]:
    """lm-eval's own local-completions model on gsm8k (text prompts, as a user would run it)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(materialize(tmp / "inc", data_dir)), include_defaults=False)
    res = lm_eval.simple_evaluate(
        model="local-completions", tasks=["gsm8k"], limit=GSM_LIMIT, task_manager=tm,
        model_args={"base_url": url + "/completions", "model": "any", "tokenizer_backend": None,
                    "tokenized_requests": False, "max_retries": 1})
    out: dict[int, dict] = {}
    for row in res["samples"]["gsm8k"]:
        out.setdefault(row["doc_id"], {"output": row["resps"][0][0], "prompt": row["arguments"][0][0]})
        out[row["doc_id"]][row["filter"]] = (row["filtered_resps"][0], row["exact_match"])
    return out


def _moebench_gsm8k(url: str, data_dir: Path) -> list[dict]:
    """moebench's own gsm8k task through the http runner against the same server."""
    from moebench.config import COMMON_TASK_SCHEMA, validate
    from moebench.runners.http import SCHEMA as HTTP_SCHEMA, HttpRunner
    from moebench.tasks.base import TaskContext
    from moebench.tasks.gsm8k import Gsm8kTask

    opts = validate({"task": "gsm8k", "limit": GSM_LIMIT}, {**COMMON_TASK_SCHEMA, **Gsm8kTask.options}, "test")
    task = Gsm8kTask(opts, TaskContext(data_dir=data_dir))
    settings = validate({"base_url": url}, HTTP_SCHEMA, "test")
    runner = HttpRunner({**settings, "name": "http", "concurrency": 1}, None)

    async def go():
        await runner.start()
        try:
            return [(await task.evaluate(item, runner)).to_dict() for item in task.items()]
        finally:
            await runner.close()
    return asyncio.run(go())


def _assert_same_gsm8k(lm_rows: dict[int, dict], mb_records: list[dict]) -> None:
    from moebench.scoring.answers import normalize_number
    assert sorted(lm_rows) == list(range(GSM_LIMIT)) and len(mb_records) == GSM_LIMIT
    for doc, rec in enumerate(mb_records):
        lm = lm_rows[doc]
        assert rec["prompt_hash"] == sha(lm["prompt"])[:16]          # the very same prompt
        assert rec["output"] == lm["output"]                         # the very same greedy text
        strict, strict_ok = lm["strict-match"]
        flexible, flex_ok = lm["flexible-extract"]
        if rec["extraction"] == "strict":
            assert rec["answer"] == normalize_number(strict)
            assert rec["correct"] == bool(strict_ok)
        elif rec["extraction"] == "flexible":
            assert strict == "[invalid]" and rec["answer"] == normalize_number(flexible)
            assert rec["correct"] == bool(flex_ok)
        else:
            assert strict == flexible == "[invalid]" and rec["correct"] is False and not strict_ok


def _gsm8k_agreement(url: str, data_dir: Path, tmp: Path) -> None:
    _assert_same_gsm8k(_lm_eval_gsm8k(url, data_dir, tmp), _moebench_gsm8k(url, data_dir))


def test_gsm8k_lm_eval_and_moebench_agree_via_serve_markov(tmp_path, data_dir):
    from moebench.serve import BackgroundServer
    with BackgroundServer(MarkovRunner()) as s:
        _gsm8k_agreement(s.url, data_dir, tmp_path)


@pytest.mark.skipif(not (ZOO_HF / "config.json").is_file(), reason="zoo HF model not built (moebench zoo build)")
def test_gsm8k_lm_eval_and_moebench_agree_via_serve_engine(tmp_path, data_dir):
    from moebench.serve import BackgroundServer
    prof = tmp_path / "engine.toml"
    prof.write_text(f'kind = "engine"\nmodel = "{ZOO_HF}"\ndtype = "float32"\ndevice = "cpu"\n')
    with BackgroundServer(_make(prof)) as s:
        _gsm8k_agreement(s.url, data_dir, tmp_path)


def test_gsm8k_lm_eval_and_moebench_agree_on_llama_server(tmp_path, data_dir, llama_profile):
    loop = LoopThread()
    runner = _make(llama_profile)
    try:
        loop.run(runner.start(str(tmp_path)))
        _gsm8k_agreement(runner.base_url + "/v1", data_dir, tmp_path)
    finally:
        loop.run(runner.close())
        loop.stop()


def test_gsm8k_agree_via_serve_over_llama_server_runner(tmp_path, data_dir, llama_profile):
    from moebench.serve import BackgroundServer
    with BackgroundServer(_make(llama_profile)) as s:
        _gsm8k_agreement(s.url, data_dir, tmp_path)


def test_run_lm_eval_cmmlu_on_llama_server_runner(tmp_path, llama_profile):
    from moebench.lmeval.adapter import run_lm_eval
    n = 3
    # Ask for every vocabulary entry so no choice token is floored (a random tiny model is flat).
    out = run_lm_eval(llama_profile, ["cmmlu_anatomy"], n, tmp_path / "run", options=AdapterOptions(top_n=60000))
    manifest, records = load_run(out)
    assert manifest["status"] == "complete" and manifest["runner"]["kind"] == "llama-server"
    stats = manifest["adapter_stats"]
    assert stats["scoring"] == "top_logprobs" and stats["requests"] == n and stats["errors"] == 0
    assert [r["item_id"] for r in records] == [f"cmmlu_anatomy/{i}" for i in range(n)]
    for r in records:
        assert r["status"] == "ok" and r["answer"] in "ABCD" and r["reference"] in "ABCD"
        assert r["correct"] == (r["answer"] == r["reference"]) and len(r["choice_logprobs"]) == 4
        assert all(np.isfinite(r["choice_logprobs"])) and len(r["prompt_hash"]) == 64
        assert "floored_tokens" not in r and len(set(r["choice_logprobs"])) == 4
    assert stats["floored_tokens"] == 0


def test_lm_eval_loglikelihood_through_serve_echo_matches_adapter(tmp_path, data_dir):
    """lm-eval's local-completions scores CMMLU through `moebench serve` (echo + prompt log-probs,
    remote tokenizer auto-detected) exactly as the in-process adapter does."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    from moebench.serve import BackgroundServer

    n = 3
    direct = load_run(evaluate_runner(MarkovRunner(), ["cmmlu_anatomy"], n, tmp_path / "run"))[1]
    tm = TaskManager(include_path=str(materialize(tmp_path / "inc", data_dir)), include_defaults=False)
    with BackgroundServer(MarkovRunner()) as s:
        res = lm_eval.simple_evaluate(model="local-completions", tasks=["cmmlu_anatomy"], limit=n, task_manager=tm,
                                      model_args={"base_url": s.url + "/completions", "model": "markov",
                                                  "max_retries": 1})
    rows = sorted(res["samples"]["cmmlu_anatomy"], key=lambda r: r["doc_id"])
    assert len(rows) == n
    for row, rec in zip(rows, direct):
        assert sha(row["arguments"][0][0]) == rec["prompt_hash"]
        assert [lp for lp, _ in row["filtered_resps"]] == pytest.approx(rec["choice_logprobs"], abs=1e-6)
        assert bool(row["acc"]) == rec["correct"]


def test_native_run_and_imported_lm_eval_run_pair_item_by_item(samples_files, tmp_path, data_dir):
    """moebench's own gsm8k run against an imported lm-eval gsm8k log of the same items: the strict-match
    rows take moebench's task name and item ids, the prompts hash alike, and every item pairs."""
    from moebench import api
    from moebench.serve import BackgroundServer, ServeOptions

    gsm = next(p for p in samples_files if "gsm8k" in p.name)
    imported = import_lm_eval([gsm], tmp_path / "imported")
    with BackgroundServer(MarkovRunner(), ServeOptions(port=0)) as s:
        suite = tmp_path / "g.toml"
        suite.write_text('name = "g"\n[[tasks]]\ntask = "gsm8k"\nlimit = 6\n[probes]\nnvml = false\n')
        runner = tmp_path / "r.toml"
        runner.write_text(f'kind = "http"\nbase_url = "{s.url}"\n')
        native, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(tmp_path / "native"),
                                              quiet=True))
    assert code == 0
    _, cmp = api.compare(str(native), str(imported), str(tmp_path / "cmp"), write_report=False)
    g = cmp["tasks"]["gsm8k"]
    assert g["n_paired"] == 6 and g["excluded"] == [], g["excluded_reasons"]
    # The other filter has no native twin: compare says why it pairs nothing.
    flex = cmp["tasks"]["gsm8k:flexible-extract"]
    assert flex["n_paired"] == 0
    assert flex["unpaired_reason"].startswith("task 'gsm8k:flexible-extract' is only in the candidate run; "
                                              "the baseline has 'gsm8k'")
    assert any(w.startswith("gsm8k:flexible-extract: nothing paired: ") for w in cmp["warnings"])
