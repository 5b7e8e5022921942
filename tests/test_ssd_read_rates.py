"""benchmarks/ssd_read_rates.py: its settings, the cgroup-v2 read cap it sets up (on a cgroup tree made in a
temporary folder), its rank correlation, a CPU run of the whole path, and the committed rows of record."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, load_benchmark

rates = load_benchmark("ssd_read_rates")


def test_settings_are_parsed_and_bad_ones_named() -> None:
    assert rates.parse_settings("disk, ram,cap:1e9,cap:250000000") == [
        ("disk", None), ("ram", None), ("cap:1e9", 10**9), ("cap:250000000", 250_000_000)]
    for bad, named in (("disk,ssd", "'ssd'"), ("cap:fast", "'cap:fast'"), ("cap:0", "'cap:0'"), ("", "no setting")):
        with pytest.raises(ValueError, match=named):
            rates.parse_settings(bad)


def cgroup_tree(tmp_path: Path, parent_controllers: str) -> tuple[Path, Path, Path]:
    """A cgroup-v2-shaped tree: root/cgroup.controllers, this process in root/svc/job, two block devices."""
    root = tmp_path / "cgroup"
    (root / "svc" / "job").mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu io memory\n")
    (root / "svc" / "cgroup.controllers").write_text(parent_controllers + "\n")
    (root / "svc" / "cgroup.subtree_control").write_text("memory\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/svc/job\n")
    block = tmp_path / "block"
    for name, majmin in (("vda", "253:0"), ("loop0", "7:0")):
        (block / name).mkdir(parents=True)
        (block / name / "dev").write_text(majmin + "\n")
    return root, proc, block


def test_cap_group_is_a_sibling_with_io_max_on_every_block_device(tmp_path: Path) -> None:
    root, proc, block = cgroup_tree(tmp_path, "cpu io memory")
    group, capped = rates.capped_group(5 * 10**8, root=root, proc_cgroup=proc, block=block)
    assert group == root / "svc" / "moebench_read_cap_500000000"
    assert capped == ["7:0", "253:0"]                      # loop0, vda: every device under /sys/block
    assert (root / "svc" / "cgroup.subtree_control").read_text() == "+io"
    assert (group / "io.max").read_text() == "253:0 rbps=500000000"   # a plain file keeps the last write


def test_cap_errors_name_the_file_and_what_was_expected(tmp_path: Path) -> None:
    root, proc, block = cgroup_tree(tmp_path, "cpu memory")
    no_io = r"svc/cgroup.controllers: expected the io controller, found \['cpu', 'memory'\]"
    with pytest.raises(rates.CapError, match=no_io):
        rates.capped_group(10**9, root=root, proc_cgroup=proc, block=block)
    proc.write_text("4:memory:/svc/job\n")                # a cgroup-v1 machine: no unified line
    with pytest.raises(rates.CapError, match=r"cgroup.controllers: expected a cgroup v2 hierarchy .*has no 0:: line"):
        rates.capped_group(10**9, root=root, proc_cgroup=proc, block=block)
    proc.write_text("0::/svc/job\n")
    (root / "svc" / "cgroup.controllers").write_text("io memory\n")
    with pytest.raises(rates.CapError, match=r"io.max: no block device took rbps=1000000000: none listed in"):
        rates.capped_group(10**9, root=root, proc_cgroup=proc, block=tmp_path / "no-block")
    assert not (root / "svc" / "moebench_read_cap_1000000000").exists()   # the empty group is removed


def test_spearman_ranks_with_ties() -> None:
    assert rates.spearman([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)
    assert rates.spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # ranks x [0, 1.5, 1.5, 3], y [0, 2, 1, 3]: 4.5 / sqrt(4.5 * 5)
    assert rates.spearman([1, 2, 2, 3], [1, 3, 2, 4]) == pytest.approx(4.5 / 22.5 ** 0.5)
    assert rates.spearman([1, 2], [1, 2]) is None
    rows = [{"tok_s": t, "disk_random_Bps": b, "disk_random_1thread_Bps": o}
            for t, b, o in ((1, 1, None), (2, 2, 3), (3, 3, 2), (4, 4, 1))]
    assert rates.correlations(rows) == {"disk_random_Bps": pytest.approx(1.0),
                                        "disk_random_1thread_Bps": pytest.approx(-1.0)}


def test_fs_type_is_the_longest_mount_above_the_path(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/vda / ext4 rw 0 0\ntmpfs /dev/shm tmpfs rw 0 0\nnone /mnt/a\\040b xfs rw 0 0\n")
    assert rates.fs_type(Path("/dev/shm/x/y"), mounts) == "tmpfs"
    assert rates.fs_type(Path("/dev/shmem"), mounts) == "ext4"
    assert rates.fs_type(Path("/mnt/a b/c"), mounts) == "xfs"
    assert rates.fs_type(Path("/x"), tmp_path / "none") is None


def test_cpu_run_of_two_settings(tmp_path: Path) -> None:
    """ram and disk settings on the CPU (tiers_h200.py --small): a row each from its own process, the pack
    folders removed afterwards."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or rates.fs_type(shm) not in rates.RAM_FILE_SYSTEMS:
        pytest.skip("no RAM-backed /dev/shm on this machine")
    disk = tmp_path / "disk"
    disk.mkdir()
    out = tmp_path / "out"
    doc = rates.main(["--out", str(out), "--settings", "ram,disk", "--disk-dir", str(disk), "--ram-dir", str(shm),
                      "--", "--small"])
    assert [r["setting"] for r in doc["rows"]] == ["ram", "disk"] and not doc["errors"]
    for r, base in zip(doc["rows"], (shm, disk)):
        assert Path(r["pack_dir"]).parent == base and r["tok_s"] > 0 and r["disk_random_Bps"] > 0
        assert r["bound_tok_s"] > 0 and r["unseen_tok_s"] > 0 and r["fs_type"] == rates.fs_type(base)
        assert r["disk_random_1thread_Bps"] > 0 and not Path(r["pack_dir"]).exists()
    assert doc["rows"][0]["fs_type"] in rates.RAM_FILE_SYSTEMS
    assert (out / "ram" / "tiers_h200.json").is_file() and (out / "disk" / "log").is_file()
    assert json.loads((out / "ssd_read_rates.json").read_text())["rows"] == doc["rows"]
    assert doc["spearman_tok_s_vs_read_rate"] is None                 # two rows: no correlation
    assert "tok/s with the 1-thread random-read rate over 2 rows: -" in (out / "ssd_read_rates.txt").read_text()


def test_ram_setting_needs_a_ram_file_system_and_a_folder(tmp_path: Path) -> None:
    if rates.fs_type(tmp_path) in rates.RAM_FILE_SYSTEMS:
        pytest.skip(f"{tmp_path} is itself RAM-backed here")
    for ram_dir, why in ((tmp_path, f"{tmp_path}: the 'ram' setting needs a RAM-backed file system (tmpfs, ramfs), "
                                    f"found {rates.fs_type(tmp_path)}"),
                         (tmp_path / "nope", "nope: expected a directory for the 'ram' setting's pack files")):
        doc = rates.main(["--out", str(tmp_path / "out"), "--settings", "ram", "--ram-dir", str(ram_dir),
                          "--", "--small"])
        assert doc["rows"] == [] and why in doc["errors"]["ram"]


def test_rows_of_record() -> None:
    """The committed rows (tiers_h200.json, key read_rates): capped reads slow the plan down in step, and
    the correlation the docs cite is the rows' own."""
    rec = json.loads((REPO / "benchmarks" / "results" / "tiers_h200.json").read_text())["read_rates"]
    for gpu, rho, rho1 in (("h100", 1.0, None), ("h200", 0.879, 0.782)):
        rows = rec[gpu]["rows"]
        got = rates.correlations(rows)
        assert got["disk_random_Bps"] == pytest.approx(rec[gpu]["spearman_tok_s_vs_read_rate"])
        assert round(got["disk_random_Bps"], 3) == rho
        one = got["disk_random_1thread_Bps"]
        assert one == rec[gpu]["spearman_tok_s_vs_1thread_rate"] and (one if one is None else round(one, 3)) == rho1
        capped = sorted((r["cap_Bps"], r["tok_s"]) for r in rows if "cap_Bps" in r)
        assert capped and all(a[1] < b[1] for a, b in zip(capped, capped[1:]) if a[0] < b[0])
        for r in rows:
            if "cap_Bps" in r:
                assert r["disk_random_Bps"] < 1.15 * r["cap_Bps"]   # the cap held in disk_read's own reads
