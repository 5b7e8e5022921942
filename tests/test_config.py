from pathlib import Path

import pytest

from moebench.config import ProfileError, load_runner, load_suite
from moebench.runners import runner_schemas
from moebench.tasks import task_schemas


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def test_shipped_profiles_load(zoo_tiered):
    """Every shipped suite and runner profile validates (runner profiles name the zoo's models)."""
    root = Path(__file__).resolve().parent.parent
    for suite in sorted((root / "suites").glob("*.toml")):
        s = load_suite(suite, task_schemas())
        assert s.tasks
    for runner in sorted((root / "runners").glob("*.toml")):
        r = load_runner(runner, runner_schemas())
        assert r.kind in ("http", "llama-server", "engine")


def test_unknown_task_key_names_file_and_key(tmp_path):
    p = write(tmp_path, "s.toml", 'name = "x"\n[[tasks]]\ntask = "gsm8k"\nshotz = 3\n')
    with pytest.raises(ProfileError) as e:
        load_suite(p, task_schemas())
    msg = str(e.value)
    assert str(p) in msg and "'shotz'" in msg and "[[tasks]] #1" in msg


def test_wrong_type_and_unknown_task(tmp_path):
    p = write(tmp_path, "s.toml", 'name = "x"\n[[tasks]]\ntask = "gsm8k"\nlimit = "ten"\n')
    with pytest.raises(ProfileError, match=r"key 'limit' must be an integer, got 'ten'"):
        load_suite(p, task_schemas())
    p = write(tmp_path, "t.toml", 'name = "x"\n[[tasks]]\ntask = "mmlu"\n')
    with pytest.raises(ProfileError, match=r"key 'task' must be one of"):
        load_suite(p, task_schemas())
    p = write(tmp_path, "u.toml", '[[tasks]]\ntask = "gsm8k"\n')
    with pytest.raises(ProfileError, match=r"missing required key 'name'"):
        load_suite(p, task_schemas())


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ProfileError, match="file not found"):
        load_suite(tmp_path / "nope.toml", task_schemas())
    p = write(tmp_path, "bad.toml", "name = \n")
    with pytest.raises(ProfileError, match="not valid TOML"):
        load_suite(p, task_schemas())


def test_runner_profile_errors(tmp_path):
    p = write(tmp_path, "r.toml", 'kind = "http"\nbase_url = "http://127.0.0.1:1/v1"\nconcurrency = 0\n')
    with pytest.raises(ProfileError, match="'concurrency' must be positive"):
        load_runner(p, runner_schemas())
    p = write(tmp_path, "k.toml", 'kind = "vllm"\n')
    with pytest.raises(ProfileError, match="key 'kind' must be one of"):
        load_runner(p, runner_schemas())
    p = write(tmp_path, "s.toml", 'kind = "http"\nbase_url = "http://x/v1"\napi_key = "sk-123"\n')
    with pytest.raises(ProfileError, match="secrets never live in files"):
        load_runner(p, runner_schemas())
