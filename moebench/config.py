"""Suite and runner profiles (docs/design.md section 2): TOML loading and validation.

Every error names the file, the key and what was expected. Schemas are small dicts of `Field`s so a
task or runner kind can declare its own keys next to its code.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypedDict, TypeVar, cast

from moebench.json_fields import is_of
from moebench.json_types import JsonObject
from moebench.secrets import literal_secrets, redact
from moebench.shipped import is_installed_profile, shipped_dir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ProfileError(ValueError):
    """A profile (suite, runner, gate rules) is malformed; the message names file and key."""


@dataclass(frozen=True)
class Field:
    """One allowed key: its type(s), whether it is required, its default, allowed values."""

    types: type | tuple[type, ...]
    required: bool = False
    default: Any = None
    choices: tuple[Any, ...] | None = None
    item_type: type | tuple[type, ...] | None = None   # for lists: type of each element
    check: Callable[[Any], str | None] | None = None     # returns an error text or None
    doc: str = ""
    # Bounds of a number, or of each number in a list (docs/profiles.md lists them all). A value
    # past them is refused when the profile loads, before it can size a prompt or a queue.
    low: float | None = None
    high: float | None = None
    low_open: bool = False                               # low itself not allowed (a timeout of 0)
    # A local path (what it names, e.g. "GGUF file"): a relative one resolves against the profile's
    # folder first (resolve_profile_paths); a required one that exists nowhere is refused naming each try.
    path: str = ""


def _num(x: float) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def bounds_text(spec: Field) -> str:
    """A field's bounds in words, e.g. "between 1 and 1,024" or "more than 0 and at most 86,400"."""
    if spec.low is not None and spec.high is not None:
        if spec.low_open:
            return f"more than {_num(spec.low)} and at most {_num(spec.high)}"
        return f"between {_num(spec.low)} and {_num(spec.high)}"
    if spec.low is not None:
        return f"{'more than' if spec.low_open else 'at least'} {_num(spec.low)}"
    return f"at most {_num(spec.high)}" if spec.high is not None else "any value"


def _bound_problem(value: Any, spec: Field) -> str | None:
    """Why a (finite) number breaks the field's bounds, else None; anything else is not its business."""
    if not is_of(value, (float,)):
        return None
    too_low = spec.low is not None and (value <= spec.low if spec.low_open else value < spec.low)
    too_high = spec.high is not None and value > spec.high
    return f"must be {bounds_text(spec)}" if too_low or too_high else None


def did_you_mean(word: str, known: Any) -> str:
    """The text ` (did you mean 'x'?)` naming the nearest known word, or "" where none is close."""
    close = difflib.get_close_matches(word, [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(t: type | tuple[type, ...]) -> str:
    ts = t if isinstance(t, tuple) else (t,)
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list", dict: "a table"}
    return " or ".join(names.get(x, x.__name__) for x in ts)


def _type_ok(value: Any, types: type | tuple[type, ...]) -> bool:
    """TOML true is not an integer here; 1 is a fine number."""
    return is_of(value, types if isinstance(types, tuple) else (types,))


def validate(table: JsonObject, schema: dict[str, Field], where: str) -> JsonObject:
    """Check `table` (a TOML table as read) against `schema`; return a copy with defaults filled in,
    which its owner then turns into its class (a runner kind's settings, a task kind's options).

    `where` names the place for error messages, e.g. "suites/quality.toml [[tasks]] #2".
    """
    if not isinstance(table, dict):
        raise ProfileError(f"{where}: expected a table, got {type(table).__name__}")
    out: JsonObject = {}
    unknown = sorted(set(table) - set(schema))
    if unknown:
        raise ProfileError(
            f"{where}: unknown key {unknown[0]!r}{did_you_mean(unknown[0], schema)}"
            + (f" (and {', '.join(map(repr, unknown[1:]))})" if len(unknown) > 1 else "")
            + f"; allowed keys: {', '.join(sorted(schema))}"
        )
    for key, spec in schema.items():
        if key not in table:
            if spec.required:
                raise ProfileError(f"{where}: missing required key {key!r} ({_type_name(spec.types)})")
            if spec.default is not None:
                out[key] = spec.default() if callable(spec.default) else spec.default
            continue
        value = table[key]
        if not _type_ok(value, spec.types):
            raise ProfileError(
                f"{where}: key {key!r} must be {_type_name(spec.types)}, got {value!r} "
                f"({type(value).__name__})"
            )
        if spec.item_type is not None and isinstance(value, list):
            for i, v in enumerate(value):
                if not _type_ok(v, spec.item_type):
                    raise ProfileError(
                        f"{where}: key {key!r} item {i} must be {_type_name(spec.item_type)}, got {v!r}"
                    )
        if spec.choices is not None and value not in spec.choices:
            raise ProfileError(
                f"{where}: key {key!r} must be one of {', '.join(map(repr, spec.choices))}, got {value!r}"
                + (did_you_mean(value, spec.choices) if isinstance(value, str) else "")
            )
        # A list's bound holds for each item; NaN and infinity are refused first, as no check
        # below is written for them (NaN > 0 is False, inf passes "positive").
        numbers = [(f" item {i}", v) for i, v in enumerate(value)] if isinstance(value, list) else [("", value)]
        for item, v in numbers:
            if isinstance(v, float) and not math.isfinite(v):
                raise ProfileError(f"{where}: key {key!r}{item} must be a finite number, got {v!r}")
        if spec.check is not None:
            problem = spec.check(value)
            if problem:
                raise ProfileError(f"{where}: key {key!r} {problem}, got {value!r}")
        for item, v in numbers:
            problem = _bound_problem(v, spec)
            if problem:
                raise ProfileError(f"{where}: key {key!r}{item} {problem}, got {v!r}")
        out[key] = value
    return out


# Shared bounds (docs/profiles.md). Generous for real use, small enough that no value can make a
# prompt, a queue or a wait that no machine survives.
MAX_PROMPT_TOKENS = 1_048_576        # a prompt or context length, in tokens
MAX_NEW_TOKENS = 131_072             # tokens generated for one request
MAX_SECONDS = 86_400                 # any timeout or wait: one day
MAX_IDLE_SECONDS = 3_600             # a measured idle window
MAX_VOCAB = 1_048_576                # K alternatives per position: up to a whole vocabulary
MAX_CLIENTS = 1_024                  # concurrent requests, clients, slots, batch rows
MAX_ITEMS = 10_000_000               # an item count (limit): above every dataset here
MAX_SEED = 2**32 - 1                 # llama.cpp's seed is a uint32
MAX_RESPONSE_BYTES = 4 * 1024**3     # one HTTP reply


def positive(value: Any) -> str | None:
    return None if value > 0 else "must be positive"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "must not be negative"


def load_toml(path: str | os.PathLike[str]) -> JsonObject:
    """The TOML file as read, before validation (ProfileError naming the file when it is missing or bad)."""
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"{p}: file not found")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ProfileError(f"{p}: not valid TOML: {e}") from None


def resolve_profile_path(name_or_path: str, folder: str) -> Path:
    """Accept a path ("runners/http.toml") or a bare name ("http") looked up in `folder`.

    Bare names are looked up in ./<folder>/ first, then in the shipped <folder>/ (the checkout's, else
    the installed package's: moebench.shipped).
    """
    p = Path(name_or_path)
    if p.suffix == ".toml" or os.sep in name_or_path or p.exists():
        if not p.is_file():
            raise ProfileError(f"{p}: file not found")
        return p
    candidates = [Path(folder) / f"{name_or_path}.toml", shipped_dir(folder) / f"{name_or_path}.toml"]
    for c in candidates:
        if c.is_file():
            return c
    names = available_profiles(folder)
    raise ProfileError(
        f"profile {name_or_path!r} not found{did_you_mean(name_or_path, names)} (looked for "
        f"{', '.join(str(c) for c in candidates)}); available {folder}: {', '.join(names) or 'none'}"
    )


def available_profiles(folder: str) -> list[str]:
    """The short names a bare profile name can take: ./<folder>/*.toml and the shipped ones."""
    names = {p.stem for d in (Path(folder), shipped_dir(folder)) if d.is_dir() for p in d.glob("*.toml")}
    return sorted(names)


def repo_root() -> Path:
    """The checkout holding suites/ and runners/ (the package's parent folder)."""
    return Path(__file__).resolve().parent.parent


def _gpu_indices(value: Any) -> str | None:
    if isinstance(value, str):
        return None if value == "all" else 'must be "all" or a list of GPU indices'
    if not value:
        return "must list at least one GPU index"
    if any(i < 0 for i in value):
        return "must hold GPU indices >= 0"
    return "must not repeat a GPU index" if len(set(value)) != len(value) else None


# --- suites -----------------------------------------------------------------------------------

PROBES_SCHEMA: dict[str, Field] = {
    "nvml": Field(bool, default=True, doc="sample GPU memory/power/energy where NVML is present"),
    "interval_ms": Field(int, default=100, check=positive, low=1, high=60_000),
    "gpu_index": Field(int, default=0, check=non_negative, low=0, high=1_023,
                       doc="the one GPU to sample (see gpu_indices)"),
    "gpu_indices": Field((list, str), item_type=int, check=_gpu_indices, low=0, high=1_023,
                         doc='several GPUs: a list of NVML indices or "all" (overrides gpu_index)'),
    "idle_s": Field(float, default=5.0, check=non_negative, low=0, high=MAX_IDLE_SECONDS,
                    doc="seconds of idle measured after the model is loaded and warm, before the first task"),
    "idle_end_s": Field(float, default=0.0, check=non_negative, low=0, high=MAX_IDLE_SECONDS,
                        doc="seconds of idle measured again after the last task (0: none)"),
    "tariff_day_per_kwh": Field(float, low=0, high=1_000, doc="electricity price by day, per kWh"),
    "tariff_night_per_kwh": Field(float, low=0, high=1_000, doc="electricity price by night, per kWh"),
    "currency": Field(str, default="EUR"),
}

class ProbeKeys(TypedDict, total=False):
    """A suite's [probes] table as load_suite gives it: PROBES_SCHEMA's keys, checked, those with a
    default filled in."""

    nvml: bool
    interval_ms: int
    gpu_index: int
    gpu_indices: list[int] | str
    idle_s: float
    idle_end_s: float
    tariff_day_per_kwh: float
    tariff_night_per_kwh: float
    currency: str


SUITE_SCHEMA: dict[str, Field] = {
    "name": Field(str, required=True),
    "description": Field(str, default=""),
    "tasks": Field(list, required=True, item_type=dict),
    "probes": Field(dict, default=dict),
}

class TaskOptions(TypedDict, total=False):
    """A suite's [[tasks]] table as `validate` returns it: COMMON_TASK_SCHEMA's keys; each task kind's
    options class (tasks/, speed/, kld/) adds its own `options` keys."""

    task: str
    name: str
    limit: int


# Keys every task entry accepts; each task kind adds its own (`Task.options`).
COMMON_TASK_SCHEMA: dict[str, Field] = {
    "task": Field(str, required=True),
    "limit": Field(int, check=positive, low=1, high=MAX_ITEMS, doc="the first N items in the dataset's own order"),
    "name": Field(str, doc="a label when a suite holds the same task twice"),
}


@dataclass
class SuiteProfile:
    name: str
    path: str
    tasks: list[TaskOptions]
    probes: ProbeKeys
    description: str = ""

    def to_dict(self) -> JsonObject:
        """The manifest's `suite` (docs/schema.md)."""
        return {"name": self.name, "path": self.path, "description": self.description,
                "tasks": self.tasks, "probes": self.probes}


def load_suite(path: str | os.PathLike[str], task_schemas: dict[str, dict[str, Field]]) -> SuiteProfile:
    """Load and validate a suite; `task_schemas` maps task kind -> its own extra keys."""
    p = Path(path)
    raw = load_toml(p)
    top = validate(raw, SUITE_SCHEMA, str(p))
    if not top["tasks"]:
        raise ProfileError(f"{p}: key 'tasks' must list at least one task")
    tasks: list[TaskOptions] = []
    for i, entry in enumerate(top["tasks"]):
        where = f"{p} [[tasks]] #{i + 1}"
        kind = entry.get("task")
        if kind not in task_schemas:
            raise ProfileError(
                f"{where}: key 'task' must be one of {', '.join(map(repr, sorted(task_schemas)))}, got {kind!r}"
                + (did_you_mean(kind, task_schemas) if isinstance(kind, str) else "")
            )
        tasks.append(cast(TaskOptions, validate(entry, {**COMMON_TASK_SCHEMA, **task_schemas[kind]}, where)))
    names = [t.get("name", t["task"]) for t in tasks]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ProfileError(f"{p}: task {sorted(dup)[0]!r} appears twice; give each a distinct 'name'")
    probes = cast(ProbeKeys, validate(top["probes"], PROBES_SCHEMA, f"{p} [probes]"))
    return SuiteProfile(name=top["name"], path=str(p), tasks=tasks, probes=probes,
                        description=top["description"])


# --- runners ---------------------------------------------------------------------------------

COMMON_RUNNER_SCHEMA: dict[str, Field] = {
    "kind": Field(str, required=True),
    "name": Field(str, doc="a label for reports; defaults to the file stem"),
    "concurrency": Field(int, default=1, check=positive, low=1, high=MAX_CLIENTS),
}


def setting(types: type | tuple[type, ...], **spec: Any) -> Any:
    """A settings dataclass field declared by its profile `Field`: the key's type, bounds and default
    are written here once; the kind's SCHEMA is read back from the class (`RunnerSettings.schema`)."""
    return setting_from(Field(types, **spec))


def setting_from(spec: Field) -> Any:
    """A settings dataclass field for an existing `Field` (a required key's attribute defaults to None:
    validation refuses a profile without it before a settings object is made)."""
    meta = {"profile_field": spec}
    if callable(spec.default):                      # a mutable default (list, dict): a fresh one each time
        return dataclasses.field(default_factory=spec.default, metadata=meta)
    return dataclasses.field(default=spec.default, metadata=meta)


class RunnerSchema(dict):
    """A runner kind's profile keys (name -> Field), and the settings class a validated profile becomes."""

    def __init__(self, fields: dict[str, Field], settings_class: type["RunnerSettings"]):
        super().__init__(fields)
        self.settings_class = settings_class


_S = TypeVar("_S", bound="RunnerSettings")


@dataclass(frozen=True)
class RunnerSettings:
    """A runner profile's settings, typed: each kind subclasses it with its own keys (`setting`).

    `given` holds the keys the profile set or validation filled with a default (what the runner
    was handed), which a runner may ask about (`llama-server`: whether a binary was named)."""

    concurrency: int = setting_from(COMMON_RUNNER_SCHEMA["concurrency"])
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def schema(cls) -> RunnerSchema:
        """The kind's own profile keys in declaration order (the common keys live in COMMON_RUNNER_SCHEMA)."""
        common = {f.name for f in dataclasses.fields(RunnerSettings)}
        return RunnerSchema({f.name: f.metadata["profile_field"] for f in dataclasses.fields(cls)
                             if "profile_field" in f.metadata and f.name not in common}, cls)

    @classmethod
    def of(cls: type[_S], table: "_S | JsonObject") -> _S:
        """Settings from a validated table (load_runner) or a hand-written one (tests, benchmarks):
        keys it does not know (kind, name) are ignored, and missing ones take their defaults."""
        if isinstance(table, cls):
            return table
        if isinstance(table, RunnerSettings):
            table = table.to_json()
        known = {f.name for f in dataclasses.fields(cls) if "profile_field" in f.metadata}
        return cls(**{k: v for k, v in table.items() if k in known}, given=frozenset(table))

    def to_json(self) -> JsonObject:
        """The settings table as validation returned it (docs/schema.md: the manifest's runner keys):
        every key set or defaulted, in schema order; an unset optional key is absent."""
        out: JsonObject = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if "profile_field" in f.metadata and value is not None:
                out[f.name] = value
        return out


@dataclass
class RunnerProfile:
    kind: str
    name: str
    path: str | None
    settings: RunnerSettings = field(default_factory=RunnerSettings)

    def redacted(self) -> JsonObject:
        """Settings safe to write into a run: secret-named values and secret-shaped text replaced,
        at every depth."""
        return {"kind": self.kind, "name": self.name, "path": self.path, **redact(self.settings.to_json())}


# said where a shipped profile of an installed moebench names a path the working directory lacks
INSTALLED_PATHS_HINT = (". This profile ships inside the installed moebench package, so its relative paths "
                        "mean the working directory: run from the folder that holds them (where `moebench zoo "
                        "build` wrote models/zoo), or copy the profile and give absolute paths")


def profile_root(profile: Path) -> Path:
    """The folder a runners/ profile's relative paths are written against: for a profile in a runners/
    folder (the shipped ones, ./runners/NAME.toml) the folder above; for one shipped inside the installed
    package (no checkout above it), and for any other, the working directory."""
    folder = profile.resolve().parent
    return folder.parent if folder.name == "runners" and not is_installed_profile(profile) else Path.cwd()


def path_bases(profile: Path) -> list[Path]:
    """Where a relative path in a profile is looked for, in order: the profile's folder, its
    profile_root, then the working directory."""
    return list(dict.fromkeys([profile.resolve().parent, profile_root(profile), Path.cwd()]))


def resolve_profile_paths(raw: JsonObject, schema: dict[str, Field], profile: Path) -> JsonObject:
    """`raw` with each relative path key (Field.path) pointing at the first base where it exists, so a
    profile works from any working directory. A path that is also right from the working directory
    keeps its text as written. A required path found nowhere is refused, naming every place tried;
    an optional one (a binary name, a tokenizer) stays as written for its runner to look up."""
    out = dict(raw)
    for key, spec in schema.items():
        value = raw.get(key)
        if not spec.path or not isinstance(value, str) or not value:
            continue
        p = Path(value).expanduser()
        if p.is_absolute():
            continue
        if key == "binary" and os.sep not in value:
            continue                        # a bare name: the tool cache, then PATH
        tried = [base / p for base in path_bases(profile)]
        found = next((t for t in tried if t.exists()), None)
        if found is not None:
            same = (Path.cwd() / p).exists() and (Path.cwd() / p).resolve() == found.resolve()
            out[key] = value if same else str(found)
        elif spec.required:
            raise ProfileError(f"{profile}: key {key!r} must name an existing {spec.path} (not found: tried "
                               f"{', '.join(str(t) for t in tried)}; a relative path resolves against the "
                               "profile's folder, the checkout for a profile in runners/, then the working "
                               "directory)" + (INSTALLED_PATHS_HINT if is_installed_profile(profile) else ""))
    return out


def load_runner(path: str | os.PathLike[str], runner_schemas: dict[str, RunnerSchema]) -> RunnerProfile:
    """A runner profile, validated against its kind's schema, its settings that kind's settings class."""
    p = Path(path)
    raw = load_toml(p)
    kind = raw.get("kind")
    if kind not in runner_schemas:
        raise ProfileError(
            f"{p}: key 'kind' must be one of {', '.join(map(repr, sorted(runner_schemas)))}, got {kind!r}"
            + (did_you_mean(kind, runner_schemas) if isinstance(kind, str) else "")
        )
    found = literal_secrets(raw)
    if found:
        raise ProfileError(f"{p}: key {found[0]!r}"
                           + (f" (and {', '.join(map(repr, found[1:]))})" if len(found) > 1 else "")
                           + ": secrets never live in files; put the value in an environment variable "
                           "(api_key_env = \"VARNAME\" for the HTTP runner's key; a llama-server inherits "
                           "moebench's environment)")
    schema = {**COMMON_RUNNER_SCHEMA, **runner_schemas[kind]}
    table = validate(resolve_profile_paths(raw, schema, p), schema, str(p))
    name = table.pop("name", None) or p.stem
    table.pop("kind")
    return RunnerProfile(kind=kind, name=name, path=str(p), settings=runner_schemas[kind].settings_class.of(table))
