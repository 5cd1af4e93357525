"""Greedy speculative decoding is token-identical to the target decoding alone."""
import numpy as np
import pytest
from factories import copy_drafter, reference_logits, tiny_drafter, tiny_target

from dspark.export import TorchBackend
from dspark.runtime import FixedLength, SamplingParams, StaticThreshold, generate
from dspark.runtime.tools.parity import greedy_match

PROMPTS = [[5, 6, 7, 8], [11, 3, 42, 42, 9, 17, 60], [70]]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("gamma", [1, 3, 6])
@pytest.mark.parametrize("scheduler", [FixedLength(), StaticThreshold(0.3), StaticThreshold(0.7)],
                         ids=["fixed", "thr0.3", "thr0.7"])
def test_greedy_identical_to_target_alone(arch, gamma, scheduler):
    target = tiny_target(arch, seed=gamma)
    drafter = copy_drafter(target, block_size=gamma)
    taus, lengths = [], set()
    for prompt in PROMPTS:
        params = SamplingParams(temperature=0.0, max_new_tokens=48)
        alone = generate(TorchBackend(target, None, 128), prompt, params, None)
        spec = generate(TorchBackend(target, drafter, 128), prompt, params, scheduler)
        match = greedy_match(alone.token_ids, spec.token_ids, reference_logits(target, prompt, alone.token_ids))
        assert match.ok, f"prompt {prompt}: {match}"
        taus.append(spec.stats.tau)
        lengths.update(spec.stats.verified)
    if isinstance(scheduler, FixedLength):
        assert max(taus) > 1.1, "the copy drafter should be accepted in repetition loops"
    else:
        assert len(lengths) > 1, "the threshold should vary the verified length"


def test_untrained_drafter_still_lossless():
    target = tiny_target("qwen3", seed=7, head_dim=24)
    drafter = tiny_drafter(target, block_size=5, markov_rank=8, head="gated")
    params = SamplingParams(max_new_tokens=40)
    alone = generate(TorchBackend(target, None, 128), PROMPTS[1], params, None)
    spec = generate(TorchBackend(target, drafter, 128), PROMPTS[1], params, FixedLength())
    assert greedy_match(alone.token_ids, spec.token_ids,
                        reference_logits(target, PROMPTS[1], alone.token_ids)).ok


def test_stop_token_inside_accepted_drafts_ends_decoding():
    target = tiny_target("llama", seed=3)
    drafter = copy_drafter(target, block_size=4)
    params = SamplingParams(max_new_tokens=48)
    alone = generate(TorchBackend(target, None, 128), PROMPTS[0], params, None)
    stop = alone.token_ids[len(alone.token_ids) // 2]
    params = SamplingParams(max_new_tokens=48, stop_token_ids=(stop,))
    for sched in (None, FixedLength()):
        g = generate(TorchBackend(target, drafter, 128), PROMPTS[0], params, sched)
        assert g.token_ids == alone.token_ids[:alone.token_ids.index(stop) + 1]
        assert g.finish_reason == "stop"


def test_max_new_tokens_is_exact():
    target = tiny_target("llama", seed=3)
    drafter = copy_drafter(target, block_size=6)
    for n in (1, 2, 7, 13):
        g = generate(TorchBackend(target, drafter, 128), PROMPTS[0], SamplingParams(max_new_tokens=n), FixedLength())
        assert len(g.token_ids) == n and g.finish_reason == "length"


def test_per_position_statistics_are_consistent():
    target = tiny_target("llama", seed=3)
    drafter = copy_drafter(target, block_size=4)
    g = generate(TorchBackend(target, drafter, 256), PROMPTS[0], SamplingParams(max_new_tokens=100), FixedLength())
    s = g.stats
    assert s.cycles == len(s.emitted) == len(s.verified)
    assert s.attempts[0] == sum(ell > 0 for ell in s.verified)  # slot 1 is verified whenever ℓ > 0
    done = 1 + np.cumsum([0] + s.emitted[:-1])  # tokens out before each cycle
    assert s.verified == [min(4, 100 - int(n) - 1) for n in done]  # γ, cut only by the budget
    assert all(s.accepts <= s.attempts) and all(s.attempts[1:] <= s.accepts[:-1])
    # every emitted token is counted: prefill token + Σ τ, less what the budget cut off
    assert 1 + sum(s.emitted) >= len(g.token_ids)
