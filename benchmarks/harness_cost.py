"""The harness's own cost: CPU-seconds of a whole `moebench run` of GSM8K (5-shot) against an instant
fake OpenAI server, beside lm-eval's `local-completions` on the same server (docs/harness-cost.md).

    python benchmarks/harness_cost.py run --variant before=/tmp/moebench_before --variant after=. \\
        --concurrency 16 64 --lm-eval --out benchmarks/results/harness_cost.json

Each variant is a moebench source tree (put first on PYTHONPATH). For every concurrency the variants
(and lm-eval) run in the order A,B,..,B,A, so a drift of the machine's load lands on both sides.
Every run is a subprocess; its CPU (user+sys) and peak RSS come from os.wait4 on that process alone,
so neither the fake server nor this script is counted. Inside the child the request phase is timed
with time.process_time (moebench: the item loop less the task's prepare; lm-eval: generate_until),
which gives the request-phase CPU per item.

    python benchmarks/harness_cost.py rss --variant after=. --items 10000 --concurrency 64

runs 10,000 items (the GSM8K test set repeated under new ids, in a scratch data folder) and reports
the run's peak RSS. `python benchmarks/harness_cost.py table RESULTS.json` prints a results file as the
markdown table of docs/harness-cost.md. `python benchmarks/harness_cost.py clients` measures bare httpx
and aiohttp clients sending the same 1,319 bodies (the choice of client).

The fake server (`serve`) is aiohttp in its own process: every completion answers one fixed text
after `--delay-s` (0 = at once).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ANSWER = "Natalia sold 48/2 = 24 clips in May.\nThe answer is 72."


# -- the fake server ------------------------------------------------------------------------------
def serve(port: int, delay_s: float) -> None:
    import asyncio

    from aiohttp import web

    count = {"n": 0}

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        count["n"] += 1
        if delay_s:
            await asyncio.sleep(delay_s)
        chat = request.path.endswith("/chat/completions")
        choice = ({"index": 0, "message": {"role": "assistant", "content": ANSWER}, "finish_reason": "stop"} if chat
                  else {"index": 0, "text": ANSWER, "logprobs": None, "finish_reason": "stop"})
        return web.json_response({"id": f"c{count['n']}", "object": "text_completion", "created": 0,
                                  "model": body.get("model", "fake"), "choices": [choice],
                                  "usage": {"prompt_tokens": 100, "completion_tokens": 16, "total_tokens": 116}})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", completions)
    app.router.add_get("/v1/models", models)

    async def main() -> None:
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", port, backlog=1024)
        await site.start()
        print(f"PORT {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())


class Server:
    def __init__(self, delay_s: float):
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "serve", "--delay-s", str(delay_s)],
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.url = f"http://127.0.0.1:{int(line.split()[1])}/v1"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- children (run inside the measured process) ------------------------------------------------------
def child_moebench(argv: list[str], report: str) -> int:
    from moebench import api, cli

    phase = {"cpu": 0.0, "prepare": 0.0, "wall": 0.0}
    inner = api._evaluate_all

    async def timed(tasks, *a, **kw):
        for t in tasks:                 # the task's prepare (datasets, prompts) is not the request phase
            prepare = t.prepare

            async def p(runner, prepare=prepare):
                c0 = time.process_time()
                try:
                    return await prepare(runner)
                finally:
                    phase["prepare"] += time.process_time() - c0
            t.prepare = p
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return await inner(tasks, *a, **kw)
        finally:
            phase["cpu"] += time.process_time() - c0
            phase["wall"] += time.perf_counter() - w0

    api._evaluate_all = timed
    rc = cli.main(argv)
    Path(report).write_text(json.dumps({"request_cpu_s": phase["cpu"] - phase["prepare"], "request_wall_s": phase["wall"],
                                        "rc": rc}))
    return rc


def child_lmeval(url: str, concurrency: int, limit: int | None, data: str, report: str) -> int:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import lm_eval
    from lm_eval.models import api_models
    from lm_eval.tasks import TaskManager

    from moebench.lmeval.local_tasks import materialize

    phase = {"cpu": 0.0, "wall": 0.0}
    inner = api_models.TemplateAPI.generate_until

    def timed(self, requests, disable_tqdm=False):
        c0, w0 = time.process_time(), time.perf_counter()
        try:
            return inner(self, requests, disable_tqdm=True)
        finally:
            phase["cpu"] += time.process_time() - c0
            phase["wall"] += time.perf_counter() - w0

    api_models.TemplateAPI.generate_until = timed
    with tempfile.TemporaryDirectory() as tmp:
        tm = TaskManager(include_path=str(materialize(Path(tmp) / "inc", Path(data))), include_defaults=False)
        res = lm_eval.simple_evaluate(
            model="local-completions", tasks=["gsm8k"], limit=limit, task_manager=tm, num_fewshot=5,
            model_args={"base_url": url + "/completions", "model": "fake", "tokenizer_backend": None,
                        "tokenized_requests": False, "max_retries": 1, "num_concurrent": concurrency},
            log_samples=False)
    n = res["n-samples"]["gsm8k"]["effective"] if "n-samples" in res else None
    Path(report).write_text(json.dumps({"request_cpu_s": phase["cpu"], "request_wall_s": phase["wall"], "items": n}))
    return 0


# -- the parent --------------------------------------------------------------------------------------
def _measure(cmd: list[str], env: dict[str, str], cwd: Path) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read()
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "cpu_s": round(ru.ru_utime + ru.ru_stime, 3), "user_s": round(ru.ru_utime, 3),
            "sys_s": round(ru.ru_stime, 3), "wall_s": round(time.perf_counter() - t0, 3),
            "peak_rss_mb": round(ru.ru_maxrss / 1024, 1), "stderr_tail": err.decode("utf-8", "replace")[-600:]}


def _profiles(tmp: Path, url: str, concurrency: int, limit: int | None) -> tuple[Path, Path]:
    suite = tmp / "gsm8k5.toml"
    suite.write_text('name = "gsm8k5"\n[[tasks]]\ntask = "gsm8k"\nshots = 5\nmax_tokens = 256\n'
                     + (f"limit = {limit}\n" if limit else "") + "[probes]\nnvml = false\n")
    runner = tmp / f"fake{concurrency}.toml"
    runner.write_text(f'kind = "http"\nbase_url = "{url}"\nmodel = "fake"\nconcurrency = {concurrency}\n')
    return suite, runner


def run_moebench(tree: Path, url: str, concurrency: int, limit: int | None, tmp: Path, data: Path | None = None,
                 extra: list[str] = ()) -> dict:
    suite, runner = _profiles(tmp, url, concurrency, limit)
    out = tmp / f"run{time.monotonic_ns()}"
    report = tmp / "report.json"
    env = {**os.environ, "PYTHONPATH": f"{tree}:{HERE}"}
    if data is not None:
        env["MOEBENCH_DATA_DIR"] = str(data)
    argv = ["run", str(suite), "--runner", str(runner), "--out", str(out), *extra]
    m = _measure([sys.executable, str(Path(__file__).resolve()), "child-moebench", "--report", str(report), "--", *argv],
                 env, tree)
    if report.exists():
        m.update(json.loads(report.read_text()))
        report.unlink()
    items = out / "items.jsonl"
    m["items"] = sum(1 for _ in items.open()) if items.exists() else 0
    m["errors"] = sum('"status": "error"' in line for line in items.open()) if items.exists() else 0
    shutil.rmtree(out, ignore_errors=True)
    return m


def run_lmeval(tree: Path, url: str, concurrency: int, limit: int | None, tmp: Path, data: Path) -> dict:
    report = tmp / "report.json"
    env = {**os.environ, "PYTHONPATH": f"{tree}:{HERE}", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "child-lmeval", "--url", url, "--concurrency", str(concurrency),
           "--data", str(data), "--report", str(report)] + (["--limit", str(limit)] if limit else [])
    m = _measure(cmd, env, tmp)
    if report.exists():
        m.update(json.loads(report.read_text()))
        report.unlink()
    return m


def _describe_trees(variants: list[str]) -> dict:
    """Each variant's tree and, where it is a git checkout, its commit and whether it was clean."""
    out = {}
    for v in variants:
        name, path = v.split("=", 1)
        tree = Path(path).resolve()
        head = subprocess.run(["git", "-C", str(tree), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True)
        out[name] = {"tree": str(tree), "commit": head.stdout.strip() if head.returncode == 0 else None,
                     "modified": bool(dirty.stdout.strip()) if head.returncode == 0 else None}
    return out


def _lm_eval_version() -> str | None:
    try:
        from importlib.metadata import version
        return version("lm_eval")
    except Exception:
        return None


def _summary(m: dict, items: int) -> dict:
    out = {k: m.get(k) for k in ("rc", "cpu_s", "wall_s", "peak_rss_mb", "request_cpu_s", "request_wall_s", "items",
                                 "errors")}
    if m.get("request_cpu_s") is not None and items:
        out["request_cpu_ms_per_item"] = round(1000 * m["request_cpu_s"] / items, 3)
    if m.get("rc"):
        out["stderr_tail"] = m.get("stderr_tail")
    return out


def cmd_run(args: argparse.Namespace) -> int:
    from moebench.datasets import data_dir
    data = Path(args.data) if args.data else data_dir()
    variants = [(name, Path(path).resolve()) for name, path in (v.split("=", 1) for v in args.variant)]
    order = [name for name, _ in variants] + (["lm-eval"] if args.lm_eval else [])
    trees = dict(variants)
    results: dict = {"machine": {"cpus": os.cpu_count(), "load_at_start": os.getloadavg()},
                     "trees": _describe_trees(args.variant), "python": sys.version.split()[0],
                     "lm_eval": _lm_eval_version() if args.lm_eval else None,
                     "delay_s": args.delay_s, "limit": args.limit, "order": "A,B,..,B,A per concurrency", "runs": []}
    server = Server(args.delay_s)
    try:
        with tempfile.TemporaryDirectory() as t:
            tmp = Path(t)
            for conc in args.concurrency:
                for rnd in range(args.rounds):
                    seq = order if rnd % 2 == 0 else list(reversed(order))
                    for name in seq:
                        if name == "lm-eval":
                            m = run_lmeval(trees[order[-2]] if len(order) > 1 else REPO, server.url, conc, args.limit,
                                           tmp, data)
                        else:
                            m = run_moebench(trees[name], server.url, conc, args.limit, tmp, data)
                        n = m.get("items") or args.limit or 1319
                        row = {"variant": name, "concurrency": conc, "round": rnd, **_summary(m, n)}
                        results["runs"].append(row)
                        print(json.dumps(row), flush=True)
    finally:
        server.stop()
    results["machine"]["load_at_end"] = os.getloadavg()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _big_mirror(src: Path, dest: Path, n: int) -> Path:
    """A data folder whose GSM8K test set holds `n` items (the real ones repeated under new ids)."""
    (dest / "gsm8k").mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "gsm8k" / "train.jsonl", dest / "gsm8k" / "train.jsonl")
    rows = [json.loads(line) for line in (src / "gsm8k" / "test.jsonl").open() if line.strip()]
    with (dest / "gsm8k" / "test.jsonl").open("w") as f:
        for i in range(n):
            row = dict(rows[i % len(rows)])
            row["question"] = f"{row['question']} (copy {i // len(rows)})" if i >= len(rows) else row["question"]
            f.write(json.dumps(row) + "\n")
    return dest


def cmd_rss(args: argparse.Namespace) -> int:
    from moebench.datasets import data_dir
    results: dict = {"items": args.items, "trees": _describe_trees(args.variant), "runs": []}
    server = Server(args.delay_s)
    try:
        with tempfile.TemporaryDirectory() as t:
            tmp = Path(t)
            data = _big_mirror(Path(args.data) if args.data else data_dir(), tmp / "data", args.items)
            for v in args.variant:
                name, path = v.split("=", 1)
                m = run_moebench(Path(path).resolve(), server.url, args.concurrency, None, tmp, data,
                                 ["--allow-modified-data"])
                row = {"variant": name, "concurrency": args.concurrency, **_summary(m, m.get("items") or args.items)}
                results["runs"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def cmd_clients(args: argparse.Namespace) -> int:
    """Bare clients sending the 1,319 5-shot GSM8K bodies: httpx (its pool sized to the concurrency)
    against aiohttp, each in its own process, A,B,B,A; CPU from os.wait4 on that process."""
    results: dict = {"runs": []}
    server = Server(args.delay_s)
    try:
        for conc in args.concurrency:
            for rnd in range(args.rounds):
                seq = ["httpx", "aiohttp"] if rnd % 2 == 0 else ["aiohttp", "httpx"]
                for client in seq:
                    m = _measure([sys.executable, str(Path(__file__).resolve()), "child-client", client,
                                  server.url, str(conc)], {**os.environ, "PYTHONPATH": str(REPO)}, REPO)
                    row = {"client": client, "concurrency": conc, "round": rnd, "cpu_s": m["cpu_s"],
                           "wall_s": m["wall_s"], "rc": m["rc"]}
                    results["runs"].append(row)
                    print(json.dumps(row), flush=True)
    finally:
        server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    return 0


def child_client(client: str, url: str, concurrency: int) -> int:
    import asyncio

    from moebench.datasets import data_dir, read_jsonl
    from moebench.prompts import gsm8k_prompt

    root = data_dir() / "gsm8k"
    shots = list(read_jsonl(root / "train.jsonl"))[:5]
    bodies = [{"model": "fake", "prompt": gsm8k_prompt(shots, row["question"]), "max_tokens": 256,
               "temperature": 0.0, "stop": ["Question:"]} for row in read_jsonl(root / "test.jsonl")]

    async def main() -> None:
        sem = asyncio.Semaphore(concurrency)
        if client == "httpx":
            import httpx
            limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
            async with httpx.AsyncClient(limits=limits, timeout=60) as c:
                async def one(body):
                    async with sem:
                        r = await c.post(url + "/completions", json=body)
                        return json.loads(r.content)
                await asyncio.gather(*(one(b) for b in bodies))
        else:
            import aiohttp
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as c:
                async def one(body):
                    async with sem:
                        async with c.post(url + "/completions", json=body) as r:
                            return json.loads(await r.read())
                await asyncio.gather(*(one(b) for b in bodies))

    asyncio.run(main())
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    """A markdown table of a `run` results file: per variant and concurrency, the range over its runs."""
    res = json.loads(Path(args.results).read_text())
    groups: dict = {}
    for r in res["runs"]:
        groups.setdefault((r["concurrency"], r["variant"]), []).append(r)

    def span(rows: list[dict], key: str, fmt: str) -> str:
        vals = sorted(r[key] for r in rows if r.get(key) is not None)
        if not vals:
            return "-"
        lo, hi = format(vals[0], fmt), format(vals[-1], fmt)
        return lo if lo == hi else f"{lo}-{hi}"

    print("| concurrency | variant | runs | whole run CPU-s | wall s | request phase CPU ms/item | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for (conc, name), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1] == "lm-eval")):
        print(f"| {conc} | {name} | {len(rows)} | {span(rows, 'cpu_s', '.2f')} | {span(rows, 'wall_s', '.2f')} | "
              f"{span(rows, 'request_cpu_ms_per_item', '.3f')} | {span(rows, 'peak_rss_mb', '.0f')} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve")
    s.add_argument("--port", type=int, default=0)
    s.add_argument("--delay-s", type=float, default=0.0)
    for name in ("run", "rss"):
        r = sub.add_parser(name)
        r.add_argument("--variant", action="append", required=True, metavar="NAME=TREE")
        r.add_argument("--delay-s", type=float, default=0.0)
        r.add_argument("--data")
        r.add_argument("--out")
        if name == "run":
            r.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
            r.add_argument("--limit", type=int)
            r.add_argument("--rounds", type=int, default=2)
            r.add_argument("--lm-eval", action="store_true")
        else:
            r.add_argument("--concurrency", type=int, default=64)
            r.add_argument("--items", type=int, default=10_000)
    c = sub.add_parser("clients")
    c.add_argument("--delay-s", type=float, default=0.0)
    c.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    c.add_argument("--rounds", type=int, default=2)
    c.add_argument("--out")
    cc = sub.add_parser("child-client")
    cc.add_argument("client", choices=("httpx", "aiohttp"))
    cc.add_argument("url")
    cc.add_argument("concurrency", type=int)
    t = sub.add_parser("table")
    t.add_argument("results")
    cm = sub.add_parser("child-moebench")
    cm.add_argument("--report", required=True)
    cm.add_argument("argv", nargs=argparse.REMAINDER)
    cl = sub.add_parser("child-lmeval")
    for a in ("--url", "--data", "--report"):
        cl.add_argument(a, required=True)
    cl.add_argument("--concurrency", type=int, default=16)
    cl.add_argument("--limit", type=int)
    args = p.parse_args(argv)
    if args.cmd == "serve":
        serve(args.port, args.delay_s)
        return 0
    if args.cmd == "child-moebench":
        rest = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
        return child_moebench(rest, args.report)
    if args.cmd == "child-lmeval":
        return child_lmeval(args.url, args.concurrency, args.limit, args.data, args.report)
    if args.cmd == "clients":
        return cmd_clients(args)
    if args.cmd == "child-client":
        return child_client(args.client, args.url, args.concurrency)
    if args.cmd == "table":
        return cmd_table(args)
    return cmd_run(args) if args.cmd == "run" else cmd_rss(args)


if __name__ == "__main__":
    sys.exit(main())
