"""The speed wing: how fast a runner answers, closed loop (clients in turn) and open loop (requests at a
rate, goodput under SLOs), one runner at a time or two interleaved (A/B).

Modules (each readable alone; arrows are imports inside the wing):
- `task.py`: `SpeedTask`, the task kind `speed`: per prompt length and client count (closed loop) or
  rate (open loop) it streams requests with unique prompts and records TTFT, prefill and decode
  throughput, sampling, draft counters and the server's /metrics state per group.
- `records.py`: the task's item records, typed: `SpeedRecord` (a `Measurement` with its `Timing` and
  `DraftFigures`, where it stood: `ClosedPlace` or `OpenPlace`, the SLOs it met, its group's summary
  `ClosedGroup` or `RateGroup` with `Goodput` and `SweepStep`) and `SkippedStep`, each with the
  `to_json` items.jsonl holds.
- `open_loop.py`: arrival schedules (poisson, gamma), SLO checks per record, the /metrics sampler
  that runs beside a group, the rate sweep and its stop rule.
- `latency.py`: the percentile summary (`Percentiles`) and a record's timing fields (`RequestTimes`)
  with its time per output token (a leaf). The wing's `from_json`s read through the package's
  `json_fields.Fields` (typed reads, each refusal naming the source and key).
- `stored.py`: `StoredRequest`, a stored speed record read back from items.jsonl or a pass file; the
  readers below take these, never the JSON.
- `compare.py`: compare.json["speed"] (`SpeedSection`): percentiles per prompt length and client
  count (`GroupStats`, `DraftSummary`), the candidate/baseline ratios with bootstrap intervals
  (`SpeedRow`), inter-token latency from speed_token_times.jsonl; its "load" part (`LoadSection`)
  comes from `load_compare.py` (`LoadRow`: goodput, SLO shares, tail sample counts; the goodput
  ratio's interval; `SweepSummary`).
- `ab.py`: `run_ab` (`moebench speed-ab`): passes of two runner profiles interleaved (ABBA), each in a
  fresh process (`python -m moebench.speed.ab`), written as ab.json and a compare.json.
- `ab_compare.py`: compare.json["speed_ab"] (`AbSection`) from the passes (`AbPass`): rounds, paired
  ratios, output identity of A and B (`OutputIdentity`).

task -> records, open_loop, stored, compare, load_compare; records -> open_loop, latency, fields;
stored -> records; compare -> load_compare, stored; open_loop -> latency, fields; load_compare,
ab_compare -> stored, latency; ab -> task, compare, ab_compare, stored. Outside the wing: the task registry names
`moebench.speed.task`, compare/build.py and compare/tables.py read the sections through `compare.py`,
`load_compare.py` and `ab_compare.py`, api.speed_ab calls `ab.run_ab`; the report's serving-load
part is report/load.py (it draws with the report's plots, so it stays in report/). The speed task
borrows the needle task's haystack for prompt text (tasks/needle.py).

A run's flow: `moebench run` with `task = "speed"` -> SpeedTask.items (one per measurement) ->
evaluate streams a request and times its tokens -> records in items.jsonl, token times in
speed_token_times.jsonl -> `moebench compare` -> speed_compare -> compare.json["speed"] -> report,
gate. docs/needle-speed-energy.md and docs/serving-load.md are the user's pages.
"""
