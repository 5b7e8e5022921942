"""The SSD plan's decode rate against the rate its disk reads at: does the read path use a faster disk?

Runs tiers_h200.py's `disk_read` and `plan_gpu_host_ssd_whole` (the engine's default SSD plan: the cold
half in a pack file behind a host-RAM cache, whole-record reads) once per read-rate setting, each in a
process of its own, and puts the rows side by side:

  - `disk`: the pack files on --disk-dir's file system, as it is;
  - `ram`: the pack files on a RAM-backed file system (--ram-dir, /dev/shm): reads at memory speed,
    the fastest "disk" the machine has;
  - `cap:<bytes/s>`: the pack files on --disk-dir's file system, the process in a cgroup-v2 group beside
    this one whose reads from every block device are capped at that rate (`io.max` rbps). Needs cgroup
    v2 with the io controller and the right to enable it (root on the device machines); where that is
    missing the setting's error names the file and what was expected, and the other settings run.

Each row: the setting's best random-read rate measured by disk_read in that process (the rate the
bound uses) and its 1-thread random rate (what a lone miss, one whole record on one reader thread,
gets), tok/s, the tier-aware bound and the share of it, and the unseen-prompt pass (page cache
dropped). The last lines are Spearman's rank correlation of tok/s with each of the two rates.

    python3 benchmarks/ssd_read_rates.py --out $OUT --settings disk,ram,cap:1e9,cap:2.5e8 -- \\
        --layers 24 --ssd-lookahead 2 --threads 1,4,8 --disk-gib 2 --disk-read-gib 0.5
    python3 benchmarks/ssd_read_rates.py --out /tmp/rates --settings disk,ram -- --small   # CPU smoke run

Arguments after `--` go to tiers_h200.py. Writes ssd_read_rates.json and .txt under --out, and each
setting's tiers_h200.json / .txt / log under --out/<setting> (cap:1e9 as cap_1e9).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PLAN = "plan_gpu_host_ssd_whole"
CGROUP_ROOT = Path("/sys/fs/cgroup")
RAM_FILE_SYSTEMS = ("tmpfs", "ramfs")              # what the ram setting takes


class CapError(RuntimeError):
    """A read cap cannot be set up on this machine (the message names the file and what was expected)."""


def parse_settings(text: str) -> list[tuple[str, int | None]]:
    """"disk,ram,cap:1e9" -> [("disk", None), ("ram", None), ("cap:1e9", 1000000000)]."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        rate = None
        if item.startswith("cap:"):
            try:
                rate = int(float(item[4:]))
            except ValueError:
                rate = 0
            if rate < 1:
                raise ValueError(f"--settings: {item!r}: a cap is cap:<read bytes per second>, e.g. cap:1e9")
        elif item not in ("disk", "ram"):
            raise ValueError(f"--settings: {item!r} is not disk, ram or cap:<read bytes per second>")
        out.append((item, rate))
    if not out:
        raise ValueError("--settings: no setting given")
    return out


def capped_group(rbps: int, root: Path = CGROUP_ROOT, proc_cgroup: Path = Path("/proc/self/cgroup"),
                 block: Path = Path("/sys/block")) -> tuple[Path, list[str]]:
    """A cgroup-v2 group beside this process's own, its reads from every block device capped at rbps
    bytes/s (io.max), and the devices (major:minor) capped. The group is a sibling because a group
    that holds processes cannot hand controllers to groups below it."""
    own = [line.split("::", 1)[1] for line in proc_cgroup.read_text().splitlines() if line.startswith("0::")]
    if not own or not (root / "cgroup.controllers").is_file():
        raise CapError(f"{root}/cgroup.controllers: expected a cgroup v2 hierarchy there "
                       f"({proc_cgroup} {'has a 0:: line' if own else 'has no 0:: line'})")
    here = root / own[0].lstrip("/")
    parent = here.parent if here != root else root
    controllers = (parent / "cgroup.controllers").read_text().split()
    if "io" not in controllers:
        raise CapError(f"{parent}/cgroup.controllers: expected the io controller, found {controllers}")
    try:
        (parent / "cgroup.subtree_control").write_text("+io")
        group = parent / f"moebench_read_cap_{rbps}"
        group.mkdir(exist_ok=True)
    except OSError as e:
        raise CapError(f"{parent}/cgroup.subtree_control: could not enable io for a group there ({e})") from None
    capped, errors = [], []
    for dev in sorted(block.glob("*/dev")):
        majmin = dev.read_text().strip()
        try:
            (group / "io.max").write_text(f"{majmin} rbps={rbps}")
            capped.append(majmin)
        except OSError as e:
            errors.append(f"{dev.parent.name} ({majmin}): {e}")
    if not capped:
        group.rmdir()
        why = "; ".join(errors) or f"none listed in {block}"
        raise CapError(f"{group}/io.max: no block device took rbps={rbps}: {why}")
    return group, capped


def fs_type(path: Path, mounts: Path = Path("/proc/mounts")) -> str | None:
    """The file system type of the mount that holds path (the longest mount point above it), or None
    where the mount table cannot be read."""
    try:
        table = mounts.read_text().splitlines()
    except OSError:
        return None
    path, best = path.resolve(), (-1, None)
    for line in table:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = Path(fields[1].encode().decode("unicode_escape"))    # /proc/mounts writes a space as \040
        if (path == point or point in path.parents) and len(point.parts) > best[0]:
            best = (len(point.parts), fields[2])
    return best[1]


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Spearman's rank correlation (average ranks for ties); None for fewer than 3 pairs."""
    if len(xs) < 3:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else None


def row(name: str, doc: dict) -> dict:
    """One setting's row from its tiers_h200.json. Besides the best random rate (over disk_read's
    thread counts, the bound's figure) it keeps the 1-thread random rate: a lone miss is one whole
    record read by one reader thread, the read a decode step waits for most often."""
    if PLAN not in doc["variants"]:
        raise RuntimeError(f"{PLAN} did not run: {doc['errors'].get(PLAN, 'no error recorded')}")
    r = doc["variants"][PLAN]
    u = r.get("unseen_prompt") or {}
    one = ((doc["variants"].get("disk_read") or {}).get("random") or {}).get("1") or {}
    return {"setting": name, "disk_random_Bps": r["disk_random_Bps"], "disk_random_1thread_Bps": one.get("Bps"),
            "tok_s": r["tok_s"], "bound_tok_s": r["bound"]["tok_s"], "pct_of_bound": r["pct_of_bound"],
            "unseen_tok_s": u.get("tok_s"), "unseen_pct_of_bound": u.get("pct_of_bound"),
            "o_direct": r["ssd"].get("o_direct"), "pack_dir": doc["pack_dir"], "gpu": doc.get("gpu")}


RATES = (("disk_random_Bps", "the best random-read rate"), ("disk_random_1thread_Bps", "the 1-thread random-read rate"))


def correlations(rows: list[dict]) -> dict[str, float | None]:
    """Spearman's rho of tok/s with each read rate, over the rows that have that rate."""
    out = {}
    for key, _ in RATES:
        have = [r for r in rows if r.get(key) is not None]
        out[key] = spearman([r[key] for r in have], [r["tok_s"] for r in have])
    return out


def table(rows: list[dict]) -> str:
    def num(v, fmt, scale=1.0):
        return format(v / scale, fmt) if v is not None else "-".rjust(len(format(0.0, fmt)))
    lines = [f"{'setting':12s} {'read GB/s':>9s} {'1-thread':>8s} {'tok/s':>8s} {'bound':>8s} {'% bound':>7s} "
             f"{'unseen tok/s':>12s} {'% bound':>7s}  pack dir"]
    for r in rows:
        one = num(r.get("disk_random_1thread_Bps"), "8.2f", 1e9)
        lines.append(f"{r['setting']:12s} {r['disk_random_Bps'] / 1e9:9.2f} {one} {r['tok_s']:8.2f} "
                     f"{num(r['bound_tok_s'], '8.1f')} {num(r['pct_of_bound'], '7.1f')} "
                     f"{num(r['unseen_tok_s'], '12.2f')} {num(r['unseen_pct_of_bound'], '7.1f')}  {r['pack_dir']}")
    rho = correlations(rows)
    for key, what in RATES:
        n = sum(r.get(key) is not None for r in rows)
        lines.append(f"Spearman rank correlation of tok/s with {what} over {n} rows: {num(rho[key], '.3f').strip()}")
    return "\n".join(lines)


def run_setting(name: str, rate: int | None, args, extra: list[str]) -> dict:
    out = Path(args.out) / name.replace(":", "_")
    out.mkdir(parents=True, exist_ok=True)
    base = Path(args.ram_dir if name == "ram" else args.disk_dir).resolve()
    if not base.is_dir():
        raise RuntimeError(f"{base}: expected a directory for the {name!r} setting's pack files")
    fs = fs_type(base)
    if name == "ram" and fs not in RAM_FILE_SYSTEMS:
        raise RuntimeError(f"{base}: the 'ram' setting needs a RAM-backed file system ({', '.join(RAM_FILE_SYSTEMS)}), "
                           f"found {fs or 'an unknown one (no /proc/mounts)'}")
    pack = base / f"moebench-read-rates-{os.getpid()}"
    cmd = [sys.executable, str(HERE / "tiers_h200.py"), "--out", str(out), "--only", f"disk_read,{PLAN}",
           "--pack-dir", str(pack), *extra]
    group, capped = capped_group(rate) if rate else (None, [])
    join = (lambda: (group / "cgroup.procs").write_text("0")) if group else None
    t0 = time.perf_counter()
    try:
        with open(out / "log", "w") as log:
            res = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=join, timeout=args.timeout)
        if res.returncode != 0:
            raise RuntimeError(f"tiers_h200.py exited {res.returncode} (log: {out / 'log'})")
        doc = json.loads((out / "tiers_h200.json").read_text())
    finally:
        shutil.rmtree(pack, ignore_errors=True)
        if group:
            try:
                group.rmdir()
            except OSError as e:
                print(f"{group}: left in place ({e})", flush=True)
    r = row(name, doc)
    r.update(wall_s=time.perf_counter() - t0, fs_type=fs)
    if group:
        r.update(cap_Bps=rate, capped_devices=capped)
    print(f"{name}: {r['disk_random_Bps'] / 1e9:.2f} GB/s random reads, {r['tok_s']:.2f} tok/s", flush=True)
    return r


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "results/ssd-read-rates"))
    ap.add_argument("--settings", default="disk,ram,cap:1e9,cap:2.5e8",
                    help="disk, ram, cap:<read bytes/s>, comma-separated")
    ap.add_argument("--disk-dir", default=".", help="where the disk and cap settings put their pack files")
    ap.add_argument("--ram-dir", default="/dev/shm", help="a RAM-backed file system for the ram setting")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for each setting's tiers_h200.py")
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:
        settings = parse_settings(args.settings)
    except ValueError as e:
        ap.error(str(e))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    rows, errors = [], {}
    for name, rate in settings:
        try:
            rows.append(run_setting(name, rate, args, extra))
        except (CapError, RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            errors[name] = str(e)
            print(f"{name}: FAILED: {e}", flush=True)
    rho = correlations(rows)
    doc = {"rows": rows, "errors": errors, "spearman_tok_s_vs_read_rate": rho["disk_random_Bps"],
           "spearman_tok_s_vs_1thread_rate": rho["disk_random_1thread_Bps"], "tiers_args": extra}
    (Path(args.out) / "ssd_read_rates.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = table(rows) + "".join(f"\nFAILED {n}: {e}" for n, e in errors.items())
    (Path(args.out) / "ssd_read_rates.txt").write_text(text + "\n")
    print(text)
    return doc


if __name__ == "__main__":
    sys.exit(1 if main()["errors"] else 0)
