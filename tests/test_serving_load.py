"""Serving load (the speed task's open loop): arrival schedules, SLOs and goodput, the /metrics names of
vLLM, SGLang and llama-server read during each group (a stand-in serving each one's documented names,
tests/serving_standin.py), the sweep's stop rule, compare's goodput ratio, the gate rule and the report.
The same suite against `moebench serve` over the engine is in test_serving_load_serve.py-style below;
against the managed vLLM in tests/test_vllm.py.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from moebench import api
from moebench.speed.load_compare import TAIL_NEEDED, tail_samples_needed
from moebench.config import COMMON_TASK_SCHEMA, ProfileError, validate
from moebench.datasets import data_dir
from moebench.tasks.base import TaskContext
from moebench.speed.open_loop import arrival_offsets
from moebench.speed.task import SpeedTask
from serving_standin import StandIn


def _items(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines() if x.strip()]


def _profile(tmp_path: Path, name: str, url: str, concurrency: int = 16) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(f'kind = "http"\nbase_url = "{url}"\nconcurrency = {concurrency}\nretries = 0\n')
    return p


def _suite(tmp_path: Path, body: str, name: str = "load", warmup: int = 0) -> Path:
    p = tmp_path / f"{name}.toml"
    p.write_text(f'name = "{name}"\n[[tasks]]\ntask = "speed"\nprompt_lengths = [64]\noutput_tokens = 4\n'
                 f'warmup = {warmup}\nmetrics_interval_s = 0.05\n{body}\n[probes]\nnvml = false\n')
    return p


def _run(suite: Path, runner: Path, out: Path) -> tuple[Path, list[dict]]:
    run_dir, code = api.run(api.RunOptions(suite=str(suite), runner=str(runner), out=str(out), quiet=True))
    items = _items(run_dir)
    errors = [(r["item_id"], r.get("error")) for r in items if r["status"] != "ok"]
    assert code == 0 and not errors, (code, errors[:3])
    return run_dir, items


def test_arrival_schedules_keep_the_rate_and_the_burstiness():
    """Poisson gaps: mean 1/rate and coefficient of variation 1; gamma with shape b: the same mean and
    CV 1/sqrt(b). Same seed, same schedule (a candidate and its baseline are offered the same load)."""
    n = 4000
    for arrival, b, cv in (("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5)):
        t = arrival_offsets(arrival, 5.0, n, b, seed=7)
        gaps = [y - x for x, y in zip(t, t[1:])]
        assert t[0] == 0.0
        assert abs(statistics.mean(gaps) - 0.2) < 0.2 * 0.08, (arrival, b, statistics.mean(gaps))
        assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - cv) < 0.12 * cv, (arrival, b)
        assert arrival_offsets(arrival, 5.0, 50, b, seed=7) == t[:50]
    assert arrival_offsets("poisson", 5.0, 50, 1.0, seed=8) != arrival_offsets("poisson", 5.0, 50, 1.0, seed=7)


def test_tail_sample_counts_are_mlperf_early_stopping_floors():
    """LoadGen's early-stopping floor with no over-latency sample at 99% confidence: h_min(t=0, p99) = 459."""
    assert TAIL_NEEDED == {"p90": 44, "p99": 459}
    assert tail_samples_needed(0.5) == 7


@pytest.mark.parametrize("opts, words", [
    ({"rate": 2.0}, ["'rate'", "poisson"]),
    ({"arrival": "poisson"}, ["exactly one of", "none"]),
    ({"arrival": "poisson", "rate": 1.0, "rates": [1.0, 2.0]}, ["exactly one of", "'rate', 'rates'"]),
    ({"arrival": "gamma", "rates": [1.0], "sweep": True}, ["exactly one of", "'sweep'"]),
])
def test_load_options_that_do_not_fit_are_refused_naming_the_key(opts, words):
    with pytest.raises(ProfileError) as e:
        SpeedTask(validate({"task": "speed", **opts}, {**COMMON_TASK_SCHEMA, **SpeedTask.options}, "test"),
                  TaskContext(data_dir=data_dir()))
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("family, source, hit_name", [
    ("vllm", "vllm", "vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total"),
    ("sglang", "sglang", "sglang:cache_hit_rate (mean of the gauge)"),
    ("llama-server", "llama-server", "llamacpp:prompt_tokens_cached_total / llamacpp:prompt_tokens_total + hits"),
])
def test_poisson_load_reads_each_servers_documented_metrics(tmp_path, family, source, hit_name):
    """Two rates against a one-slot server (about 40 ms a request): at 4 req/s it keeps up, at 60 req/s
    requests queue. Every record carries its SLO verdicts and its group's server state; the group at
    60 req/s saw a queue, the planted prefix-cache hit rate (0.25) and preemptions (vLLM: one per request)
    come back exactly."""
    suite = _suite(tmp_path, 'arrival = "poisson"\nrates = [4.0, 60.0]\nrequests = 12\n'
                             'slo_ttft_s = 0.2\nslo_tpot_s = 0.05\n')
    with StandIn(family, slots=1) as server:
        run_dir, items = _run(suite, _profile(tmp_path, family, server.url), tmp_path / "run")
    assert len(items) == 24
    for r in items:
        assert r["arrival"] == "poisson" and r["rate"] in (4.0, 60.0)
        assert set(r["slo"]) == {"ttft_s_met", "tpot_s_met"}
        assert r["slo_met"] == (r["slo"]["ttft_s_met"] and r["slo"]["tpot_s_met"])
        assert r["slo"]["ttft_s_met"] == (r["ttft_s"] <= 0.2)
    by_rate = {rate: [r for r in items if r["rate"] == rate] for rate in (4.0, 60.0)}
    fast = by_rate[60.0][0]["group"]["server"]
    assert fast["source"] == source and fast["n_samples"] >= 3
    assert fast["queue_length"]["max"] >= 2, fast
    assert fast["running"]["max"] == 1.0
    assert fast["prefix_cache_hit_rate"] == pytest.approx(0.25)
    assert fast["names"]["prefix_cache_hit_rate"] == hit_name
    if family == "vllm":
        assert fast["preemptions"] == 12 and fast["kv_cache_usage"]["max"] == pytest.approx(0.1)
    elif family == "sglang":
        assert fast["preemptions"] is None and fast["kv_cache_usage"]["max"] == pytest.approx(0.1)
    else:
        assert fast["kv_cache_usage"] is None and fast["preemptions"] is None      # b11434 exports neither
    # queueing at 60 req/s shows in TTFT: the last requests waited for the others
    assert max(r["ttft_s"] for r in by_rate[60.0]) > 3 * statistics.median(r["ttft_s"] for r in by_rate[4.0])
    summary = json.loads((run_dir / "manifest.json").read_text())["summary"]["speed"]["load"]
    rows = {r["rate"]: r for r in summary["rows"]}
    for rate, row in rows.items():
        met = sum(1 for r in by_rate[rate] if r["slo_met"])
        assert row["n_sent"] == 12 and row["slo_met_share"] == pytest.approx(met / 12)
        assert row["goodput"] == pytest.approx(met / row["duration_s"])
        assert by_rate[rate][0]["group"]["goodput"] == pytest.approx(row["goodput"])       # in the records too
        assert by_rate[rate][0]["group"]["slo_met_share"] == pytest.approx(met / 12)
        assert row["ttft_s"]["n"] == 12 and row["ttft_s"]["p99_indicative"] and row["ttft_s"]["p90_indicative"]
    assert rows[4.0]["slo_met_share"] > rows[60.0]["slo_met_share"]
    samples = [json.loads(x) for x in (run_dir / "speed_server_metrics.jsonl").read_text().splitlines()]
    assert {s["group"] for s in samples} == {"64/r4", "64/r60"}


def test_compare_gate_and_report_of_two_builds(tmp_path):
    """A slow build (one slot, 10 ms a token) against a fast one (four slots, 2 ms a token), the same
    poisson schedule at 4 and 60 req/s: compare gives goodput per rate with the ratio's interval and both
    sides' server state; [speed] min_goodput_ratio passes for the fast build as candidate and fails the
    other way round; the report draws goodput against rate and marks the p99 over 12 requests indicative."""
    suite = _suite(tmp_path, 'arrival = "poisson"\nrates = [4.0, 60.0]\nrequests = 12\nslo_ttft_s = 0.15\n')
    runs = {}
    for name, slots, token_s in (("slow", 1, 0.01), ("fast", 4, 0.002)):
        with StandIn("vllm", slots=slots, token_s=token_s) as server:
            runs[name], _ = _run(suite, _profile(tmp_path, name, server.url), tmp_path / name)
    from moebench.gate import run_gate
    rules = tmp_path / "gate.toml"
    rules.write_text("[speed]\nmin_goodput_ratio = 0.8\n")
    verdicts = {}
    for base, cand in (("slow", "fast"), ("fast", "slow")):
        out = tmp_path / f"cmp_{cand}"
        api.compare(str(runs[base]), str(runs[cand]), out=str(out))
        load = json.loads((out / "compare.json").read_text())["speed"]["load"]
        rows = {r["rate"]: r for r in load["rows"]}
        assert set(rows) == {4.0, 60.0} and load["unpaired_groups"] == []
        for r in rows.values():
            assert r["n_baseline"] == r["n_candidate"] == 12
            assert r["goodput_ratio"] == pytest.approx(r["candidate"]["goodput"] / r["baseline"]["goodput"])
            lo, hi = r["goodput_ratio_ci95"]
            assert lo <= r["goodput_ratio"] <= hi
            for side in ("baseline", "candidate"):
                assert r[side]["server"]["source"] == "vllm" and r[side]["server"]["preemptions"] == 12
        print(f"\n{cand} vs {base}: " + "; ".join(
            f"{rate:g} req/s goodput {r['baseline']['goodput']:.3g} -> {r['candidate']['goodput']:.3g}, ratio "
            f"{r['goodput_ratio']:.3g} [{r['goodput_ratio_ci95'][0]:.3g}, {r['goodput_ratio_ci95'][1]:.3g}], queue max "
            f"{r['baseline']['server']['queue_length']['max']:g} -> {r['candidate']['server']['queue_length']['max']:g}"
            for rate, r in rows.items()))
        code = run_gate(str(out), str(rules), quiet=True)
        verdicts[cand] = (code, json.loads((out / "gate.json").read_text()))
        html = (out / "report.html").read_text()
        assert "goodput vs offered rate" in html and "<svg" in html.split("goodput vs offered rate")[1][:400]
        assert "indicative (n 12 &lt; 459)" in html
        assert "Server state per group" in html and "vllm (" in html
    assert verdicts["fast"][0] == 0, verdicts["fast"][1]
    assert verdicts["slow"][0] == 1, verdicts["slow"][1]
    check = next(c for c in verdicts["slow"][1]["checks"] if c["rule"] == "min_goodput_ratio")
    assert "60 req/s" in check["message"], check


def test_sweep_stops_after_the_step_that_queues(tmp_path):
    """A one-slot server taking about 110 ms a request saturates near 9 req/s. A sweep from 2 req/s
    doubling each step stops after the first step whose median TTFT exceeds the first step's by more than
    0.15 s (the queue), reports the saturation rate as the step before, and sends nothing after."""
    suite = _suite(tmp_path, 'arrival = "poisson"\nsweep = true\nsweep_start_rate = 2.0\nsweep_factor = 2.0\n'
                             'sweep_steps = 6\nrequests = 10\nsweep_max_queue_delay_s = 0.15\n'
                             'sweep_max_error_rate = 0.05\nslo_ttft_s = 0.3\n', warmup=1)
    with StandIn("sglang", slots=1, first_s=0.05, token_s=0.02) as server:
        run_dir, items = _run(suite, _profile(tmp_path, "sweep", server.url), tmp_path / "run")
    rates = sorted({r["rate"] for r in items})
    assert rates == [2.0, 4.0, 8.0, 16.0, 32.0, 64.0] and len(items) == 60
    ran = sorted({r["rate"] for r in items if not r.get("sweep_skipped")})
    skipped = sorted({r["rate"] for r in items if r.get("sweep_skipped")})
    assert ran and skipped and ran[-1] < skipped[0] and ran + skipped == rates
    last = next(r for r in items if r["rate"] == ran[-1])["group"]["sweep"]
    assert last["stop"] and "queueing delay" in last["stop"] and last["queue_delay_s"] > 0.15
    assert all(next(r for r in items if r["rate"] == x)["group"]["sweep"]["stop"] is None for x in ran[:-1])
    sweep = json.loads((run_dir / "manifest.json").read_text())["summary"]["speed"]["load"]["sweeps"]["64"]
    assert sweep["rates_run"] == ran and sweep["stopped_at_rate"] == ran[-1]
    assert sweep["saturation_rate"] == (ran[-2] if len(ran) > 1 else None)
    assert 8.0 <= ran[-1] <= 32.0, ran           # 110 ms a request: the queue grows past ~9 req/s
    print(f"\nsweep ran {ran}, stopped: {last['stop']}, saturation {sweep['saturation_rate']} req/s")


class ServeProcess:
    """`moebench serve --runner PROFILE --port 0` in its own process, as it is deployed."""

    def __init__(self, profile: Path, log: Path):
        import subprocess
        import sys
        from conftest import REPO
        self.log = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "moebench.cli", "serve", "--runner", str(profile),
                                      "--port", "0"], cwd=REPO, stdout=subprocess.PIPE, stderr=self.log, text=True)
        line = self.proc.stdout.readline()                  # "serving NAME (KIND) on URL"
        assert " on http://" in line, (line, log.read_text()[-2000:])
        self.url = line.strip().rsplit(" on ", 1)[1]

    def __enter__(self) -> "ServeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.log.close()


def test_poisson_load_against_moebench_serve_two_builds(tmp_path, zoo_tiered):
    """The serving-load shape (poisson, two rates, SLOs) against `moebench serve` over the in-repo engine:
    the zoo's BF16 model and its tiered build as two builds. Both runs read moebench serve's /metrics
    (queue length, running requests); the compare gives goodput ratios with intervals per rate and both
    builds' server state."""
    suite = tmp_path / "load.toml"
    suite.write_text('name = "serving-load-serve"\n[[tasks]]\ntask = "speed"\narrival = "poisson"\n'
                     'rates = [1.0, 6.0]\nrequests = 8\nprompt_lengths = [64]\noutput_tokens = 8\n'
                     'slo_ttft_s = 0.5\nslo_tpot_s = 0.1\nwarmup = 3\nmetrics_interval_s = 0.1\n[probes]\nnvml = false\n')
    runs = {}
    for build, model in (("bf16", "tiny-moe"), ("tiered", "tiny-moe-tiered")):
        engine = tmp_path / f"engine-{build}.toml"
        engine.write_text(f'kind = "engine"\nmodel = "{zoo_tiered / model}"\ndtype = "float32"\n'
                          f'device = "cpu"\nmax_seq_len = 512\n')
        with ServeProcess(engine, tmp_path / f"serve-{build}.log") as srv:
            client = tmp_path / f"http-{build}.toml"
            client.write_text(f'kind = "http"\nbase_url = "{srv.url}"\ntokenize = "vllm"\nconcurrency = 12\n'
                              f'retries = 0\ntimeout_s = 120\n')
            runs[build], items = _run(suite, client, tmp_path / build)
        assert len(items) == 16
        for r in items:
            server = r["group"]["server"]
            assert server["source"] == "moebench serve" and server["n_samples"] >= 2
            assert server["names"]["queue_length"] == "moebench:num_requests_waiting"
            assert server["running"]["max"] <= 1       # the engine runner serves one request at a time
            assert abs(r["prompt_tokens"] - 64) <= 1 and "slo_met" in r
    out = tmp_path / "cmp"
    api.compare(str(runs["bf16"]), str(runs["tiered"]), out=str(out))
    load = json.loads((out / "compare.json").read_text())["speed"]["load"]
    assert [r["rate"] for r in load["rows"]] == [1.0, 6.0]
    for r in load["rows"]:
        print(f"\n{r['rate']:g} req/s: goodput bf16 {r['baseline']['goodput']:.3g} (within SLOs "
              f"{r['baseline']['slo_met_share']:.0%}), tiered {r['candidate']['goodput']:.3g} "
              f"({r['candidate']['slo_met_share']:.0%}), ratio {r['goodput_ratio']} {r['goodput_ratio_ci95']}; "
              f"queue max {r['baseline']['server']['queue_length']['max']:g} / "
              f"{r['candidate']['server']['queue_length']['max']:g}")
        if r["goodput_ratio"] is not None:
            lo, hi = r["goodput_ratio_ci95"]
            assert lo <= r["goodput_ratio"] <= hi
        else:                                            # the baseline met no SLO at this rate: no ratio
            assert r["baseline"]["slo_met_share"] == 0
    assert any(r["goodput_ratio"] is not None for r in load["rows"])
    html = (out / "report.html").read_text()
    assert "goodput vs offered rate" in html and "moebench serve (" in html


def test_goodput_rule_is_inconclusive_where_the_baseline_met_no_slo(tmp_path):
    """An SLO no request can meet (TTFT within 1 ms): goodput 0 on both sides, no ratio at any rate;
    [speed] min_goodput_ratio is INCONCLUSIVE (exit 3) and says why, never a pass or a fail."""
    from moebench.gate import EXIT_INCONCLUSIVE, run_gate
    suite = _suite(tmp_path, 'arrival = "gamma"\nburstiness = 0.5\nrates = [10.0]\nrequests = 6\nslo_ttft_s = 0.001\n')
    runs = []
    for name in ("a", "b"):
        with StandIn("llama-server", slots=2) as server:
            runs.append(_run(suite, _profile(tmp_path, name, server.url), tmp_path / name)[0])
    out = tmp_path / "cmp"
    api.compare(str(runs[0]), str(runs[1]), out=str(out))
    row = json.loads((out / "compare.json").read_text())["speed"]["load"]["rows"][0]
    assert row["baseline"]["goodput"] == 0 and row["goodput_ratio"] is None and row["baseline"]["burstiness"] == 0.5
    rules = tmp_path / "gate.toml"
    rules.write_text("[speed]\nmin_goodput_ratio = 0.9\n")
    assert run_gate(str(out), str(rules), quiet=True) == EXIT_INCONCLUSIVE
    check = next(c for c in json.loads((out / "gate.json").read_text())["checks"] if c["rule"] == "min_goodput_ratio")
    assert check["verdict"] == "inconclusive" and "the baseline met no SLO" in check["message"], check


def test_compare_prints_goodput_per_rate(tmp_path):
    """`moebench compare` (the CLI) prints the goodput lines and summary.md carries them."""
    from conftest import moebench_cli
    suite = _suite(tmp_path, 'arrival = "poisson"\nrates = [20.0]\nrequests = 8\nslo_ttft_s = 0.5\n')
    runs = []
    for name in ("a", "b"):
        with StandIn("vllm", slots=2) as server:
            runs.append(_run(suite, _profile(tmp_path, name, server.url), tmp_path / name)[0])
    proc = moebench_cli("compare", str(runs[0]), str(runs[1]), "--out", str(tmp_path / "cmp"), check=True)
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("64 tokens @ 20 req/s"))
    assert "goodput" in line and "ratio" in line and "server vllm/vllm" in line and "preemptions 8 -> 8" in line
    assert "TTFT p99 indicative (baseline n 8, candidate n 8 < 459)" in line
    assert "64 tokens @ 20 req/s" in (tmp_path / "cmp" / "summary.md").read_text()
    print("\n" + "\n".join(x for x in proc.stdout.splitlines() if "req/s" in x or "serving load" in x))


def test_poisson_load_against_llama_server_with_metrics(tmp_path):
    """A managed llama-server (built from source) started with `--metrics`, two slots, on the zoo's q8_0
    GGUF: each group reads its llamacpp:* names (requests_processing, requests_deferred, the prompt-token
    counters). Speed prompts are unique and sent with cache_prompt off, so the prefix-cache hit rate the
    counters give is 0."""
    from conftest import REPO
    gguf = REPO / "models" / "zoo" / "tiny-moe-q8_0.gguf"
    if not gguf.is_file():
        pytest.skip(f"{gguf} not built (moebench zoo build)")
    runner = tmp_path / "llama.toml"
    runner.write_text(f'kind = "llama-server"\nmodel = "{gguf}"\nparallel = 2\nconcurrency = 8\nctx_size = 2048\n'
                      'args = ["--threads", "1", "--metrics"]\n')
    suite = _suite(tmp_path, 'arrival = "poisson"\nrates = [2.0, 12.0]\nrequests = 8\nslo_ttft_s = 0.5\n', warmup=1)
    run_dir, items = _run(suite, runner, tmp_path / "run")
    assert len(items) == 16
    seen_running = 0.0
    for r in items:
        server = r["group"]["server"]
        assert server["source"] == "llama-server" and server["n_samples"] >= 2, server
        assert server["names"]["queue_length"] == "llamacpp:requests_deferred"
        assert server["names"]["running"] == "llamacpp:requests_processing"
        assert server["prefix_cache_hit_rate"] == 0.0 and server["kv_cache_usage"] is None
        assert server["running"]["max"] <= 2                      # two slots
        seen_running = max(seen_running, server["running"]["max"])
    assert seen_running >= 1
    print("\nllama-server: " + "; ".join(
        f"{rate:g} req/s queue max {g['server']['queue_length']['max']:g}, running max {g['server']['running']['max']:g}"
        for rate, g in sorted({r['rate']: r['group'] for r in items}.items())))


def test_goodput_interval_holds_the_ratio_when_a_side_met_none_or_all():
    """Haldane's half-request correction moves the interval's centre; it must still hold the measured
    ratio: 0 where the candidate met no SLO, 2 where it met all against half."""
    from moebench.speed.load_compare import goodput_ratio_ci
    base = {"duration_s": 2.0, "n_sent": 8, "slo_met_share": 0.5}
    lo, hi = goodput_ratio_ci(base, {"duration_s": 2.0, "n_sent": 8, "slo_met_share": 0.0})
    assert lo == 0.0 and hi > 0.5
    lo, hi = goodput_ratio_ci(base, {"duration_s": 2.0, "n_sent": 8, "slo_met_share": 1.0})
    assert lo <= 2.0 <= hi and lo > 0.5
    lo, hi = goodput_ratio_ci(base, {"duration_s": 2.0, "n_sent": 8, "slo_met_share": 0.75})
    assert lo < 1.5 < hi
