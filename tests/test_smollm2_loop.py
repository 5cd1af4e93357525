"""The speculative loop on the real default target (SmolLM2-135M-Instruct GGUF)."""
import pytest
from factories import reference_logits

from dspark.export import TorchBackend
from dspark.export.drafter import init_drafter
from dspark.runtime import FixedLength, SamplingParams, StaticThreshold, generate
from dspark.runtime.tools.parity import greedy_match

pytestmark = pytest.mark.slow

PROMPTS = ["What is 17 times 23?", "Write a haiku about the sea."]
MAX_NEW = 24


@pytest.fixture(scope="module")
def alone(smollm2) -> list[tuple[str, list[int], list[int], object]]:
    """(text, prompt ids, the target's own greedy tokens, their reference logits) of each prompt."""
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=smollm2.stop_token_ids)
    runs = []
    for text in PROMPTS:
        prompt = list(smollm2.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                            add_generation_prompt=True, return_dict=True)["input_ids"])
        tokens = generate(TorchBackend(smollm2.model, None, 512), prompt, params, None).token_ids
        assert len(tokens) > 5
        runs.append((text, prompt, tokens, reference_logits(smollm2.model, prompt, tokens)))
    return runs


@pytest.mark.parametrize("scheduler", [FixedLength(), StaticThreshold(0.5)], ids=["fixed", "thr0.5"])
def test_greedy_identical_with_untrained_drafter(smollm2, alone, scheduler):
    target = smollm2.model
    drafter = init_drafter(target, num_layers=1, block_size=4, markov_rank=32, markov_head_type="vanilla")
    params = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=smollm2.stop_token_ids)
    for text, prompt, tokens, logits in alone:
        spec = generate(TorchBackend(target, drafter, 512), prompt, params, scheduler)
        match = greedy_match(tokens, spec.token_ids, logits)
        assert match.ok, f"{text!r}: {match}"
