"""The engine runner on the zoo's trained tiny MoE: generation, stop strings, log-probs, tokenizer."""
from __future__ import annotations

import asyncio
import math

import pytest

from moebench.runners.base import Capability, GenerateRequest, RunnerError
from moebench.runners.engine import EngineRunner, prefetch_choices


@pytest.fixture(scope="module")
def runner(zoo):
    r = EngineRunner({"model": str(zoo / "tiny-moe"), "dtype": "float32", "max_seq_len": 1024}, "test")
    asyncio.run(r.start())
    yield r
    asyncio.run(r.close())


def test_capabilities_cover_kld_and_router_signals(runner):
    for cap in (Capability.FULL_LOGITS, Capability.ROUTER_TRACE, Capability.TOKENIZE, Capability.GENERATE):
        assert cap in runner.capabilities


def test_greedy_generation_is_deterministic_and_cut_at_stop(runner):
    req = GenerateRequest(prompt="Prince Andrew looked at", max_tokens=40)
    a = asyncio.run(runner.generate(req))
    b = asyncio.run(runner.generate(req))
    assert a.text == b.text and a.token_ids == b.token_ids and a.output_tokens == len(a.token_ids)
    assert a.prompt_tokens == len(asyncio.run(runner.tokenize("Prince Andrew looked at")))
    assert len(a.token_times) == len(a.token_ids)
    # Stop at the first occurrence of a word the free generation produced.
    word = a.text.split()[1] if len(a.text.split()) > 1 else a.text.split()[0]
    cut = asyncio.run(runner.generate(GenerateRequest(prompt=req.prompt, max_tokens=40, stop=[word])))
    assert cut.finish_reason == "stop" and word not in cut.text
    assert a.text.startswith(cut.text)


def test_top_logprobs_are_a_distribution_and_greedy_is_first(runner):
    res = asyncio.run(runner.generate(GenerateRequest(prompt="The count said", max_tokens=3, top_logprobs=5)))
    assert len(res.top_logprobs) == 3
    first = res.top_logprobs[0]
    assert len(first) == 5 and all(lp <= 0 for lp in first.values())
    greedy_text = asyncio.run(runner.detokenize(res.token_ids[:1]))
    assert max(first, key=first.get) == greedy_text
    dist = asyncio.run(runner.next_logprobs(asyncio.run(runner.tokenize("The count said"))))
    assert math.isclose(sum(math.exp(v) for v in dist.values()), 1.0, rel_tol=1e-3)


def test_too_long_prompt_is_a_runner_error(runner):
    with pytest.raises(RunnerError, match="max_seq_len"):
        asyncio.run(runner.generate(GenerateRequest(prompt=list(range(5, 1100)), max_tokens=4)))


def test_identity_hashes_the_model_files(runner, zoo):
    ident = runner.identity()
    assert ident["model"]["path"].endswith("tiny-moe") and len(ident["model"]["sha256"]) == 64
    assert "model.safetensors" in ident["model"]["files"] and ident["model"]["tiered"] is False


def test_identity_names_int8_activations(zoo, runner):
    a8 = EngineRunner({"model": str(zoo / "tiny-moe"), "experts_impl": "triton", "int8_activations": True}, None)
    assert a8.identity()["build"]["int8_activations"] is True
    assert "int8_activations" not in runner.identity()["build"]


def test_identity_records_the_engine_decode_config(zoo, runner):
    """The manifest's build identity carries every decode switch and launch shape of the engine, as
    the engine that runs has them (device defaults resolved)."""
    a8 = EngineRunner({"model": str(zoo / "tiny-moe"), "experts_impl": "triton", "int8_activations": True}, None)
    plain, quant = runner.identity()["build"]["decode"], a8.identity()["build"]["decode"]
    assert plain["experts_impl"] == "auto" and quant["experts_impl"] == "triton"
    assert quant["int8_activations"] is True and plain["int8_activations"] is False
    assert quant["fused_ops"] is True and plain["fused_ops"] is False          # resolved from experts_impl
    assert quant["launch"]["gate_up/int4/a8"] == {"BN": 8, "BK": 1024, "num_warps": 4, "num_stages": 2}
    assert plain["decode_mode"] == "WORDS" and plain["pdl"] is True
    assert plain == runner.engine.identity()["decode"]          # the started engine decodes with it
    # resolved once, by the runner: the engine holds the runner's own config object, not a re-resolved copy
    assert runner.decode.is_resolved and runner.engine.decode is runner.decode


def test_tiered_stack_mib_reaches_the_decode_config(zoo, runner):
    small = EngineRunner({"model": str(zoo / "tiny-moe"), "tiered_stack_mib": 64}, None)
    assert small.identity()["build"]["decode"]["tiered_stack_bytes"] == 64 << 20
    assert runner.identity()["build"]["decode"]["tiered_stack_bytes"] == 1024 << 20


@pytest.mark.parametrize("key", ["prefetch_host", "int8_activations"])
def test_fused_kernel_options_without_the_fused_kernels_are_a_profile_error(zoo, key):
    from moebench.config import ProfileError
    with pytest.raises(ProfileError, match=f"runners/x.toml: key '{key}' needs experts_impl"):
        EngineRunner({"model": str(zoo / "tiny-moe"), key: True}, "runners/x.toml")


def test_prefetch_early_without_prefetch_host_is_a_profile_error(zoo):
    from moebench.config import ProfileError
    with pytest.raises(ProfileError, match="runners/x.toml: key 'prefetch_early' needs prefetch_host = true"):
        EngineRunner({"model": str(zoo / "tiny-moe"), "experts_impl": "triton", "prefetch_early": True},
                     "runners/x.toml")


def test_on_text_streams_pieces_that_join_to_the_text(runner):
    """GenerateRequest.on_text gets the output as it is generated (from the engine's worker thread);
    the pieces join to the final text, or run past it where a stop string cut the text."""
    pieces: list[str] = []
    res = asyncio.run(runner.generate(GenerateRequest(prompt="Prince Andrew looked at", max_tokens=24,
                                                      ignore_eos=True, on_text=pieces.append)))
    assert len(pieces) > 5 and "".join(pieces) == res.text
    word = res.text.split()[2]
    pieces.clear()
    cut = asyncio.run(runner.generate(GenerateRequest(prompt="Prince Andrew looked at", max_tokens=24,
                                                      ignore_eos=True, stop=[word], on_text=pieces.append)))
    assert cut.finish_reason == "stop" and "".join(pieces).startswith(cut.text + word)


def test_prefetch_auto_turns_on_only_where_it_measured_faster():
    """prefetch_host / prefetch_early "auto": both on with CUDA, the fused Triton experts and experts off
    the GPU (host RAM, or host RAM and SSD); off elsewhere and for SSD-only offload, each with its
    why; a value set in the profile is kept."""
    on = prefetch_choices({}, "cuda:0", "triton", ["host"])
    assert on["prefetch_host"]["value"] is True and on["prefetch_early"]["value"] is True
    assert on["prefetch_host"]["why"].startswith("auto on CUDA") and "host experts" in on["prefetch_host"]["why"]
    assert prefetch_choices({"prefetch_host": "auto"}, "cuda", "triton", ["host", "ssd"])["prefetch_host"]["value"]
    off = {
        "cpu": prefetch_choices({}, "cpu", "triton", ["host"]),
        "impl": prefetch_choices({}, "cuda", "auto", ["host"]),
        "resident": prefetch_choices({}, "cuda", "triton", []),
        "ssd only": prefetch_choices({}, "cuda", "triton", ["ssd"]),
    }
    for case, got in off.items():
        assert got["prefetch_host"]["value"] is False and got["prefetch_early"]["value"] is False, case
        assert got["prefetch_host"]["why"].startswith("auto"), case
    assert "CPU" in off["cpu"]["prefetch_host"]["why"] and "'auto'" in off["impl"]["prefetch_host"]["why"]
    assert "in GPU memory" in off["resident"]["prefetch_host"]["why"]
    assert "all on the SSD" in off["ssd only"]["prefetch_host"]["why"]
    assert off["cpu"]["prefetch_early"]["why"] == "auto: off, prefetch_host is off"
    # explicit values are kept, on any device
    kept = prefetch_choices({"prefetch_host": False}, "cuda", "triton", ["host"])
    assert kept["prefetch_host"] == {"value": False, "why": "profile"} and kept["prefetch_early"]["value"] is False
    kept = prefetch_choices({"prefetch_host": True, "prefetch_early": False}, "cuda", "triton", ["host"])
    assert kept["prefetch_host"] == {"value": True, "why": "profile"}
    assert kept["prefetch_early"] == {"value": False, "why": "profile"}
    cpu = prefetch_choices({"prefetch_host": True}, "cpu", "triton", ["host"])
    assert cpu["prefetch_host"]["value"] is True and cpu["prefetch_early"]["value"] is False


def test_prefetch_keys_take_true_false_or_auto():
    from moebench.config import ProfileError, validate
    from moebench.runners.engine import SCHEMA
    done = validate({"model": "m"}, SCHEMA, "runners/x.toml")
    assert done["prefetch_host"] == done["prefetch_early"] == "auto"
    with pytest.raises(ProfileError, match="prefetch_host"):
        validate({"model": "m", "prefetch_host": "yes"}, SCHEMA, "runners/x.toml")
