"""The KLD wing: how far a candidate's next-token distributions are from a baseline's, per token.

Modules (each readable alone; arrows are imports inside the wing):
- `task.py`: `KldTask`, the task kind `kld` (teacher-forced). A baseline run stores the corpus's
  token ids and per chunk the top-K log-probs (whole distributions for the first chunks); a
  candidate run (--baseline) scores the same ids and stores its per-token KLD, same-top, dp and nll.
  How the log-probs are had is picked from the runner's capabilities: full logits (the engine), a
  server's prompt log-probs, or llama.cpp's own llama-perplexity.
- `chunk_records.py`: the task's item records per chunk (`BaselineChunk`, `CandidateChunk`,
  `KldEstimate`, the llama-perplexity pair), each with one `to_json` giving the items.jsonl record, and
  `KldItem`, any KLD record read back through one `from_json` that names the record and key.
- `sampled_task.py`: `SampledKldTask` (`method = "sampled"`), a Monte Carlo estimate on the
  baseline's own samples, one log-prob per token on each side. `KldTask(opts)` returns it.
- `stats.py`: the statistics exactly as llama-perplexity computes them (`TokenStats`, its running
  sums `TokenSums`, `summarize`), the top-K lower bound, the base-file log-prob codec. Imports
  nothing of moebench.
- `sampled_stats.py`: the sampled method's estimators and bootstrap interval. A leaf too.
- `runs.py`: where the arrays live in a run directory (<run>/kld/<task>/, `KldFolders`: a task's role
  and folders, shared by both task classes), the baseline's meta.json (`KldMeta`, read back through
  one `from_json` that names the file and key on bad input), how the arrays are read back, and the compare.json["kld"]
  section built from them (`kld_section`, `sampled_section`); `KldError`.
- `sections.py`: that section's parts as classes (`ForcedSection`, `LlamaSection`, `SampledSection`,
  the top-K check `TopkVsExact`), each with one `to_json`.
- `perplexity_tool.py`: driving `llama-perplexity` (base file write/read, `--kl-divergence`, parsing
  its printed statistics into `PrintedKld`, which llama_stats.json is written from and read back into). What a llama-server candidate passes to it (`PerplexityPlan`) is decided by
  the runner with tools/llama_args.py, outside the wing, since the runner owns its flags.
- `compare.py`: `kld_compare` (the boundary with compare/build.py: raw manifest and records in,
  compare.json["kld"] out), `KldComparison`, the section plus the MoE signals (router agreement, expert
  usage, load skew) from both runs' router traces.

task -> chunk_records, runs -> stats; sampled_task -> runs, sampled_stats;
runs -> sections -> chunk_records, perplexity_tool, sampled_stats, stats; task, runs -> perplexity_tool
-> stats; compare -> runs. Outside the wing: the task registry (tasks/__init__.py) names `moebench.kld.task`,
compare/build.py loads `moebench.kld.compare`, cli.py maps `KldError` to its exit code. What a server
answers for prompt or sampled log-probs is parsed in runners/prompt_logprobs.py and
runners/sampled_logprobs.py (the HTTP runners call them; runners never import a task's wing).

A run's flow: `moebench run` with a suite naming `task = "kld"` -> KldTask.prepare tokenizes the
corpus (baseline) or reads the baseline's meta and ids (candidate) -> one item per chunk, evaluated
through the runner -> arrays under <run>/kld/<task>/ and one record per chunk in items.jsonl ->
`moebench compare` -> kld_compare reads the candidate's arrays -> compare.json["kld"] -> report, gate.
docs/kld.md is the user's page.
"""
