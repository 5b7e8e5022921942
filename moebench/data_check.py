"""Is the data a run reads the mirror's data? Each file a run uses, checked against SHA256SUMS.

A data folder that carries SHA256SUMS (the mirror does; `moebench data fetch` writes it) is checked
file by file, only the files the run reads, before any request:
- `verified`: the file's sha256 is the one SHA256SUMS lists (and, for a file of the project's own
  mirror, the one moebench/mirror/SHA256SUMS lists, so an edited SHA256SUMS does not vouch for an
  edited file);
- `modified`: it differs. `moebench run` refuses the run (exit 2, naming the file) unless
  `--allow-modified-data`, and then the manifest and the report say so;
- `unverified`: nothing to check it against (no SHA256SUMS in the folder, or the file not listed in
  it). The run goes on and one line says so.
A folder without SHA256SUMS still verifies a file whose bytes are the project's own mirror's.
The result is the manifest's `data_verification` (docs/schema.md).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from moebench.datasets import DatasetError

SUMS = "SHA256SUMS"
PROJECT_SUMS = "moebench/mirror/SHA256SUMS"
VERIFIED, MODIFIED, UNVERIFIED = "verified", "modified", "unverified"


def read_sums(path: Path) -> dict[str, str]:
    """`<sha256>  <path>` lines (sha256sum's text or `*` binary form) as path -> lower-case hex."""
    out: dict[str, str] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition(" ")
        name = name[1:] if name[:1] in (" ", "*") else name
        if not sep or len(digest) != 64 or not name or any(c not in "0123456789abcdefABCDEF" for c in digest):
            raise DatasetError(f"{path}: line {n} is not '<sha256>  <relative path>': {line!r}")
        out[name.strip()] = digest.lower()
    return out


def _project_sums() -> dict[str, str]:
    from moebench.data_fetch import mirror_files
    return {f.path: f.sha256 for f in mirror_files()}


@dataclass(frozen=True)
class FileCheck:
    """One used file: its sha256 and status; `against` the list that vouched for it or not (verified,
    modified), `expected` the sha256 that list holds (modified), `reason` why unverified."""

    sha256: str
    status: str
    against: str | None = None
    expected: str | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, str]:
        out = {"sha256": self.sha256, "status": self.status}
        for key in ("reason", "against", "expected"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


@dataclass
class DataVerification:
    """The manifest's `data_verification`: the list used (`sums_file`, None where the folder has
    none), each used file's check, and whether modified data was allowed (set by check_before_run)."""

    sums_file: str | None
    files: dict[str, FileCheck]
    allow_modified: bool | None = None

    def with_status(self, status: str) -> list[str]:
        return [rel for rel, e in self.files.items() if e.status == status]

    def to_json(self) -> dict[str, str | bool | None | dict[str, dict[str, str]]]:
        out: dict[str, str | bool | None | dict[str, dict[str, str]]] = {
            "sums_file": self.sums_file, "files": {rel: e.to_json() for rel, e in self.files.items()}}
        if self.allow_modified is not None:
            out["allow_modified"] = self.allow_modified
        return out


def verify_data_files(root: Path, data_files: dict[str, str]) -> DataVerification:
    """Each used file's sha256 and status (verified / modified / unverified) against `root`'s
    SHA256SUMS and the project's own list; `sums_file` names the list used, or None."""
    sums_path = Path(root) / SUMS
    listed = read_sums(sums_path) if sums_path.is_file() else None
    project = _project_sums()
    files: dict[str, FileCheck] = {}
    for rel, digest in sorted(data_files.items()):
        if listed is not None and rel in listed:
            expected, against = listed[rel], str(sums_path)
            if expected == digest and rel in project and project[rel] != digest:
                expected, against = project[rel], PROJECT_SUMS      # the folder's list was edited too
        elif rel in project and project[rel] == digest:
            expected, against = digest, PROJECT_SUMS
        else:
            files[rel] = FileCheck(digest, UNVERIFIED, reason=f"no {SUMS} in {root}" if listed is None
                                   else f"not listed in {sums_path}")
            continue
        files[rel] = (FileCheck(digest, VERIFIED, against=against) if expected == digest
                      else FileCheck(digest, MODIFIED, against=against, expected=expected))
    return DataVerification(str(sums_path) if listed is not None else None, files)


def modified_error(root: Path, verification: DataVerification) -> str:
    """The refusal: which file differs from which list, and the two ways on."""
    modified = verification.with_status(MODIFIED)
    e = verification.files[modified[0]]
    more = len(modified) - 1
    return (f"data file {Path(root) / modified[0]} differs from {e.against} (sha256 {e.sha256}, expected "
            f"{e.expected})" + (f" and {more} more file(s) differ" if more else "")
            + ": it is not the mirror's data; restore it (`moebench data fetch`) or pass "
              "--allow-modified-data to run on it, recorded in the manifest and the report")


def notes(root: Path, verification: DataVerification) -> list[str]:
    """One line each for files run unverified and (allowed) modified files; none when all verified."""
    out = []
    unverified = verification.with_status(UNVERIFIED)
    if unverified:
        why = (f"{root} has no {SUMS}" if verification.sums_file is None
               else f"not listed in {verification.sums_file}")
        out.append(f"note: data not verified ({why}): {', '.join(unverified)}; "
                   "the manifest records them as unverified")
    modified = verification.with_status(MODIFIED)
    if modified:
        out.append(f"warning: running on modified data (--allow-modified-data): {', '.join(modified)} "
                   f"{'differs' if len(modified) == 1 else 'differ'} from SHA256SUMS; the manifest and the "
                   "report say so")
    return out


def check_before_run(root: Path, data_files: dict[str, str],
                     allow_modified: bool) -> tuple[DataVerification, list[str]]:
    """The manifest's `data_verification` and the lines to print, or UsageError (exit 2) when a
    file differs from SHA256SUMS and `allow_modified` is off."""
    from moebench.errors import UsageError
    verification = verify_data_files(root, data_files)
    if verification.with_status(MODIFIED) and not allow_modified:
        raise UsageError(modified_error(root, verification))
    verification.allow_modified = bool(allow_modified)
    return verification, notes(root, verification)
