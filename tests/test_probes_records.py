"""The probe summary read back from a manifest (probes.records.*.from_json) gives the same JSON again,
and a manifest whose summary has the wrong shape is refused naming the file, the key path and the type."""
from __future__ import annotations

import json

import pytest

from moebench.probes.energy import cards_summary
from moebench.probes.energy_compare import memory_energy_compare
from moebench.probes.records import CardsSummary, SummaryError
from moebench.store import StoreError


def _rows(cards, watts):
    """Two seconds at 100 W idle then `watts` per card, sampled every 0.1 s, with the counter integrating it."""
    out, mj = [], {c: 0.0 for c in cards}
    for i in range(50):
        t = i * 0.1
        for c in cards:
            w = 100.0 if t < 2 else watts
            mj[c] += w * 100
            out.append({"t": t, "gpu": c, "power_instant_w": w, "energy_mj": mj[c], "mem_used_bytes": 2**30 * (c + 1),
                        "mem_free_bytes": 2**31, "mem_total_bytes": 2**32, "mem_reserved_bytes": 2**20})
    return out


PHASES = [{"phase": "baseline_idle", "t": 0.0}, {"phase": "decode", "t": 2.0}]


@pytest.mark.parametrize("cards", [[0], [0, 1, 2]])
def test_summary_round_trips_through_json(cards):
    written = cards_summary(_rows(cards, 300.0), PHASES, tokens={"decode": 500},
                            tariffs={"day": 0.25, "night": 0.1, "currency": "EUR"})
    on_disk = json.loads(json.dumps(written))
    back = CardsSummary.from_json(on_disk, "manifest.json: probes.nvml.summary")
    assert json.dumps(back.to_json()) == json.dumps(written)
    assert back.cards == len(cards) and back.energy.per_token["decode"].tokens == 500
    assert back.energy.cost_per_million_tokens.night["decode"].gross == pytest.approx(
        back.energy.kwh_per_million_tokens["decode"].gross * 0.1)


def _manifest(summary):
    return {"probes": {"nvml": {"available": True, "summary": summary}}}


def test_compare_of_two_rigs_names_each_card_and_the_sum():
    base = cards_summary(_rows([0, 1], 300.0), PHASES, tokens={"decode": 500})
    cand = cards_summary(_rows([0, 1], 200.0), PHASES, tokens={"decode": 500})
    cmp = memory_energy_compare(_manifest(base), _manifest(cand))
    assert list(cmp["energy"]["gpus"]) == ["gpu0", "gpu1", "sum"]
    # two cards at 300 W then 200 W: net decode energy per token falls to (200-100)/(300-100) of the baseline's
    assert cmp["energy"]["per_token"]["decode"]["net_ratio"] == pytest.approx(0.5, rel=0.02)
    assert cmp["memory"]["cards"] == {"baseline": {"cards": 2, "headline": "sum of GPUs 0, 1"},
                                      "candidate": {"cards": 2, "headline": "sum of GPUs 0, 1"}}


@pytest.mark.parametrize("path, value, message", [
    (("memory", "peak_used_bytes"), "40 GB",
     "candidate manifest.json.probes.nvml.summary.memory: key 'peak_used_bytes' is a string, expected an integer or null"),
    (("energy", "phases", "decode", "duration_s"), None,
     "candidate manifest.json.probes.nvml.summary.energy.phases.decode: key 'duration_s' is null, expected a number"),
    (("energy", "whole_run"), [1, 2],
     "candidate manifest.json.probes.nvml.summary.energy.whole_run: expected an object, got a list"),
    (("gpus",), {"0": {}}, "candidate manifest.json.probes.nvml.summary: key 'gpus' is an object, expected a list"),
])
def test_a_bad_summary_is_refused_naming_file_key_and_type(path, value, message):
    summary = json.loads(json.dumps(cards_summary(_rows([0], 300.0), PHASES, tokens={"decode": 500})))
    part = summary
    for key in path[:-1]:
        part = part[key]
    part[path[-1]] = value
    good = cards_summary(_rows([0], 300.0), PHASES)
    with pytest.raises(SummaryError) as e:
        memory_energy_compare(_manifest(good), _manifest(summary))
    assert str(e.value) == message
    assert isinstance(e.value, StoreError)       # the CLI reports it as a malformed run, one line


def test_a_missing_key_is_named():
    summary = json.loads(json.dumps(cards_summary(_rows([0, 1], 300.0), PHASES)))
    del summary["gpus"][1]["energy"]["whole_run"]
    with pytest.raises(SummaryError, match=r"^baseline manifest.json.probes.nvml.summary.gpus\[1\].energy: "
                                           r"missing key 'whole_run'$"):
        memory_energy_compare(_manifest(summary), _manifest(summary))
