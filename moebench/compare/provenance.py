"""Whether two runs can be read against each other, from their manifests only: the same data files
per task, the same suite and sampling settings, and which run measured itself against which.

compare pairs items by id; these checks catch what ids cannot: a dataset file that changed under the
same ids (pairing it would report flips that are the data's, not the model's), suites or sampling
that differ (the figures are of different experiments), and a candidate given as the baseline.
"""
from __future__ import annotations

from pathlib import Path

from moebench.json_types import JsonObject, JsonValue
from moebench.store.records import ItemRecord, Manifest

# A task's files live in the mirror folder named after its kind, except these.
DATA_FOLDERS = {"needle": ("haystack",), "speed": ("haystack",)}
# Suite task keys and runner keys that change what a model is asked or how it samples.
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "typical_p", "seed", "max_tokens", "n_predict",
                 "repeat_penalty", "presence_penalty", "frequency_penalty", "stop")
LLAMA_SAMPLING_FLAGS = {"--temp": "temperature", "--top-p": "top_p", "--top-k": "top_k", "--min-p": "min_p",
                        "--seed": "seed", "-s": "seed", "--n-predict": "n_predict", "-n": "n_predict",
                        "--repeat-penalty": "repeat_penalty", "--presence-penalty": "presence_penalty",
                        "--frequency-penalty": "frequency_penalty"}


def _suite_tasks(m: Manifest) -> dict[str, JsonObject]:
    """The suite's task entries (docs/schema.md manifest `suite.tasks`) by their name in the suite; each
    is a suite table as written, its keys open (task kinds take keys of their own), compared key by key."""
    suite = m.suite or {}
    out = {}
    for t in suite.get("tasks") or []:
        if isinstance(t, dict) and t.get("task"):
            out[str(t.get("name") or t["task"])] = t
    return out


def task_data_files(m: Manifest, task: str) -> dict[str, str]:
    """The data files (path in the mirror -> sha256) a run's task read, from its manifest."""
    files = m.extra.get("data_files") if isinstance(m.extra.get("data_files"), dict) else {}
    entry = _suite_tasks(m).get(task, {})
    kind = str(entry.get("task") or task.split(":", 1)[0])
    folders = DATA_FOLDERS.get(kind, (kind,))
    named = {str(v) for k, v in entry.items() if k in ("corpus", "path", "file") and isinstance(v, str)}
    return {p: h for p, h in files.items() if p.split("/", 1)[0] in folders or p in named}


def data_mismatch(bm: Manifest, cm: Manifest, task: str) -> dict[str, dict[str, str]]:
    """The files both runs' task read under the same path but with different contents."""
    b, c = task_data_files(bm, task), task_data_files(cm, task)
    return {p: {"baseline": b[p], "candidate": c[p]} for p in sorted(set(b) & set(c)) if b[p] != c[p]}


def unverified_data(m: Manifest, task: str) -> dict[str, str]:
    """The files a run's task read that no SHA256SUMS vouched for: path -> `modified` (run with
    --allow-modified-data) or `unverified` (no list named the file). A run made before data
    verification existed carries no statuses and gives none here."""
    ver = m.extra.get("data_verification") if isinstance(m.extra.get("data_verification"), dict) else {}
    files = ver.get("files") if isinstance(ver.get("files"), dict) else {}
    read = task_data_files(m, task)
    return {p: str(e.get("status")) for p, e in sorted(files.items())
            if p in read and isinstance(e, dict) and e.get("status") in ("modified", "unverified")}


def unverified_files(sides: dict[str, dict[str, str]]) -> str:
    """Which side read which unvouched files (three at most per side)."""
    parts = []
    for side, files in sides.items():
        shown = ", ".join(f"{p} ({status})" for p, status in list(files.items())[:3])
        more = f" and {len(files) - 3} more" if len(files) > 3 else ""
        parts.append(f"the {side} read {shown}{more}")
    return "; ".join(parts)


def unverified_reason(sides: dict[str, dict[str, str]]) -> str:
    """One sentence: the unvouched files and what follows from them."""
    return unverified_files(sides) + ": data no SHA256SUMS vouched for is no evidence for a verdict"


def data_mismatch_reason(files: dict[str, dict[str, str]], paired: bool = True) -> str:
    """One sentence naming the differing files (three at most) and what follows from it."""
    shown = "; ".join(f"{p}: sha256 {h['baseline'][:12]} in the baseline, {h['candidate'][:12]} in the candidate"
                      for p, h in list(files.items())[:3])
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    then = ("the same item ids may hold other questions or answers, so none is paired" if paired
            else "its figures compare different inputs")
    return f"the runs read different data ({shown}{more}): {then}"


def _runner_sampling(m: Manifest) -> dict[str, JsonValue]:
    """Sampling settings a runner profile fixes: top-level keys, extra_body, llama-server args."""
    r = m.runner or {}
    out = {k: r[k] for k in SAMPLING_KEYS if k in r}
    body = r.get("extra_body") if isinstance(r.get("extra_body"), dict) else {}
    out.update({f"extra_body.{k}": body[k] for k in SAMPLING_KEYS if k in body})
    args = r.get("args") if isinstance(r.get("args"), list) else []
    for i, a in enumerate(args):
        flag, eq, val = str(a).partition("=")
        if flag in LLAMA_SAMPLING_FLAGS:
            value = val if eq else (args[i + 1] if i + 1 < len(args) else None)
            out[f"args {flag}"] = value
    return out


def _task_kinds(m: Manifest) -> set[str]:
    return {str(t.get("task")) for t in _suite_tasks(m).values()}


def _greedy_chain(m: Manifest) -> str | None:
    """The sampler chain a llama-server run's greedy requests named (`build.greedy_samplers`), as
    text; None where no llama-server ran. A run recorded before the runner named a chain sent the
    server's default one."""
    build = m.build or {}
    if (m.runner or {}).get("kind") != "llama-server" or not build.get("server_started"):
        return None
    chain = build.get("greedy_samplers")
    if not isinstance(chain, dict):
        return "the server's default chain"
    top_k = f" (top_k {chain['top_k']})" if chain.get("top_k") is not None else ""
    return f"{chain.get('samplers')}{top_k}"


def setup_differences(bm: Manifest, cm: Manifest) -> list[str]:
    """One line per difference in what the two runs asked: suite, task settings, runner sampling,
    and where both measured speed, the llama-server sampler chain of greedy requests (it moves
    decode speed, not the tokens)."""
    out = []
    bs, cs = bm.suite or {}, cm.suite or {}
    if bs.get("name") != cs.get("name"):
        out.append(f"different suites: the baseline ran {bs.get('name')!r}, the candidate {cs.get('name')!r}")
    bt, ct = _suite_tasks(bm), _suite_tasks(cm)
    for task in [t for t in bt if t in ct]:
        keys = sorted(k for k in set(bt[task]) | set(ct[task]) if k not in ("name",)
                      and bt[task].get(k) != ct[task].get(k))
        if keys:
            out.append(f"{task}: suite settings differ: " + ", ".join(
                f"{k} {bt[task].get(k)!r} (baseline) vs {ct[task].get(k)!r} (candidate)" for k in keys))
    br, cr = _runner_sampling(bm), _runner_sampling(cm)
    keys = sorted(k for k in set(br) | set(cr) if br.get(k) != cr.get(k))
    if keys:
        out.append("runner sampling settings differ: " + ", ".join(
            f"{k} {br.get(k)!r} (baseline) vs {cr.get(k)!r} (candidate)" for k in keys))
    bg, cg = _greedy_chain(bm), _greedy_chain(cm)
    if bg and cg and bg != cg and "speed" in _task_kinds(bm) & _task_kinds(cm):
        out.append(f"llama-server greedy requests named other sampler chains: {bg} (baseline) vs {cg} "
                   f"(candidate); the same tokens, but its cost per token is in the decode rates")
    return out


def _same_run(a: object, b: Path) -> bool:
    try:
        return bool(a) and Path(str(a)).resolve() == b.resolve()
    except OSError:
        return False


def reversed_pair(base_dir: Path, cand_dir: Path, bm: Manifest) -> str | None:
    """Why the two runs look given the wrong way round: the run given as the baseline measured
    itself against the run given as the candidate (`run --baseline`)."""
    if _same_run(bm.extra.get("baseline_run"), cand_dir):
        return (f"the runs look swapped: {base_dir}, given as the baseline, was run with --baseline {cand_dir} "
                f"(the run given as the candidate); compare takes BASELINE then CANDIDATE: "
                f"`moebench compare {cand_dir} {base_dir}`")
    return None


def kld_notes(kld: JsonObject) -> list[str]:
    """What a reader of compare.json's kld section must know beside its figures (another baseline, a
    lower bound); `kld` is the section as the KLD wing's `kld_compare` wrote it."""
    out = []
    if kld.get("warning"):
        out.append(f"kld: {kld['warning']}")
    est = kld.get("estimate") if isinstance(kld.get("estimate"), dict) else {}
    if est.get("lower_bound"):
        note = f"kld: mean {kld.get('mean')!r} is a top-{est.get('k')} lower bound of the full KLD"
        tve = kld.get("topk_vs_exact") if isinstance(kld.get("topk_vs_exact"), dict) else {}
        if tve.get("exact_mean") is not None:
            note += f"; the exact mean on the {tve.get('n_tokens')} tokens of the full chunks is {tve['exact_mean']!r}"
        out.append(note)
    return out


def kld_absent_reason(cand_records: list[ItemRecord], cm: Manifest) -> str | None:
    """Why compare has no kld section although the candidate ran a KLD task, else None."""
    kld = [r for r in cand_records if r.task == "kld" or r.item_id.startswith("kld/")]
    if not kld:
        return None
    if not cm.extra.get("baseline_run"):
        return ("the candidate ran KLD without --baseline: it recorded a KLD baseline and measured nothing; "
                "run it again with --baseline BASE")
    if not any(r.status == "ok" for r in kld):
        return "every KLD chunk of the candidate errored"
    return "the candidate has no KLD chunk measured against a baseline"
