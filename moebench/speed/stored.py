"""A speed record as its readers see it once stored: read back from items.jsonl (or an A/B pass file)
into `StoredRequest`, its keys' types checked and a bad one refused naming the source and key.
speed/compare.py, speed/load_compare.py and speed/ab_compare.py read these, never the JSON.

A stored record is what records.SpeedRecord (or SkippedStep) wrote plus the store's own keys
(item_id, status, error); an error record holds little more than its id, so most fields are optional.
"""
from __future__ import annotations

from dataclasses import dataclass

from moebench.json_types import JsonValue
from moebench.runners.metrics import SpecDecodeDelta
from moebench.json_fields import Fields, is_of
from moebench.speed.latency import RequestTimes
from moebench.speed.records import ClosedGroup, DraftFigures, RateGroup, Sampling, group_from_json


@dataclass(frozen=True)
class StoredRequest:
    """One stored speed record: its id and status, timing, where it stood, the SLOs and draft counters,
    its group's summary and its output (the A/B identity check compares outputs)."""

    item_id: str
    status: str                          # "ok" or "error" (an older record without one is ok)
    times: RequestTimes
    prompt_tokens: int | None
    prompt_length: int | None
    clients: int | None                  # closed loop
    rate: float | None                   # open loop
    slo_met: bool | None                 # None where the suite set no SLOs
    sweep_skipped: bool                  # a sweep step not sent
    sweep_stopped_at: str | None
    sampling: Sampling | None            # older records carry none
    draft: DraftFigures | None           # per-request draft counters (llama-server)
    group: ClosedGroup | RateGroup | None
    group_spec_decode: SpecDecodeDelta | None   # the server's draft counters over the group (vLLM)
    output_token_ids: list[int] | None
    output: str | None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def measured(self) -> bool:
        """An ok record with a time to first token (a skipped sweep step has none)."""
        return self.ok and self.times.ttft_s is not None

    @staticmethod
    def from_json(obj: JsonValue, source: str) -> StoredRequest:
        """A stored record; `source` names its file. Refused naming the file, item and key."""
        f = Fields(obj, source)
        item_id = f.need_str("item_id")
        f = Fields(obj, f"{source}, item {item_id}")
        times = RequestTimes(f.num("ttft_s"), f.num("prefill_tok_s"), f.num("decode_tok_s"), f.num("e2e_s"),
                             f.integer("output_tokens"))
        sampling, group, spec = f.at("sampling"), f.at("group"), f.at("group_spec_decode")
        return StoredRequest(
            item_id=item_id, status=f.text("status") or "ok", times=times,
            prompt_tokens=f.integer("prompt_tokens"), prompt_length=f.integer("prompt_length"),
            clients=f.integer("clients"), rate=f.num("rate"), slo_met=f.flag("slo_met"),
            sweep_skipped=bool(f.flag("sweep_skipped")), sweep_stopped_at=f.text("sweep_stopped_at"),
            sampling=Sampling.from_json(sampling) if sampling is not None else None,
            draft=DraftFigures.from_json(f),
            group=group_from_json(group) if group is not None else None,
            group_spec_decode=_spec_decode(spec) if spec is not None else None,
            output_token_ids=_token_ids(f), output=f.text("output"))


def _spec_decode(f: Fields) -> SpecDecodeDelta:
    return {"draft_n": f.need_int("draft_n"), "draft_n_accepted": f.need_int("draft_n_accepted"),
            "acceptance_rate": f.num("acceptance_rate"), "source": f.need_str("source")}


def _token_ids(f: Fields) -> list[int] | None:
    ids = f.obj.get("output_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not all(is_of(i, (int,)) for i in ids):
        raise ValueError(f"{f.source}: key 'output_token_ids' must be a list of integers")
    return [i for i in ids if isinstance(i, int)]


def read_records(records: list[JsonValue], source: str) -> list[StoredRequest]:
    """Stored speed records (JSON objects as read) parsed, each refused naming `source` and its item."""
    return [StoredRequest.from_json(r, source) for r in records]
