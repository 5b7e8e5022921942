"""training.json read back into its records (zoo.train.TrainingRecord): the committed file gives the
same bytes again, and a bad one is refused naming the file and the key path (read_weights: ZooBuildError)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moebench import jsonout
from moebench.zoo.build import WEIGHTS_DIR, ZooBuildError, read_weights
from moebench.zoo.train import TRAINING_FILE, WEIGHTS_FILE, TrainingRecord

COMMITTED = WEIGHTS_DIR / TRAINING_FILE


def test_committed_training_record_round_trips_byte_for_byte():
    text = COMMITTED.read_text()
    record = TrainingRecord.from_json(json.loads(text), str(COMMITTED))
    assert jsonout.document_text(record.to_json(), indent=2) + "\n" == text
    assert record.seed == record.summary.config.seed == 1234
    assert record.summary.config.texts == ("haystack/war_and_peace.txt", "gsm8k/train.jsonl")
    assert record.summary.fixture is not None and record.summary.fixture.config.steps > 0
    assert record.hf_config["model_type"] == "qwen3_moe"


def _edited(tmp_path: Path, edit) -> Path:
    doc = json.loads(COMMITTED.read_text())
    edit(doc)
    (tmp_path / TRAINING_FILE).write_text(json.dumps(doc))
    (tmp_path / WEIGHTS_FILE).symlink_to(WEIGHTS_DIR / WEIGHTS_FILE)
    return tmp_path


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.pop("hf_config"), "key 'hf_config' missing"),
    (lambda d: d["train_config"].update(steps="300"), ".train_config: key 'steps' is '300', expected an integer"),
    (lambda d: d["shape"].update(rope_theta=None), ".shape: key 'rope_theta' is None, expected a number"),
    (lambda d: d["fixture"]["config"].pop("lr"), ".fixture.config: key 'lr' missing"),
    (lambda d: d["fixture"]["items"][0].pop("branch"), ".fixture.items[0]: expected an object with keys id, "),
    (lambda d: d["data"].append("gsm8k"), ".data: expected a list of objects with keys file, sha256, tokens"),
    (lambda d: d.update(seed=1), "key 'seed' is 1, train_config.seed is 1234"),
    (lambda d: d.update(notes="x"), "unknown key 'notes'"),
])
def test_a_bad_training_record_names_file_and_key(tmp_path, edit, message):
    weights = _edited(tmp_path, edit)
    with pytest.raises(ZooBuildError) as e:
        read_weights(weights)
    assert str(e.value).startswith(f"{weights / TRAINING_FILE}")
    assert message in str(e.value)


def test_read_weights_gives_the_typed_record():
    record = read_weights(WEIGHTS_DIR)
    assert isinstance(record, TrainingRecord) and record.weights == WEIGHTS_FILE
