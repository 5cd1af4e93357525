"""The speculative loop on the real default target (SmolLM2-135M-Instruct GGUF)."""
import pytest
from factories import reference_logits

from dspark.export import TorchBackend
from dspark.export.drafter import init_drafter
from dspark.runtime import FixedLength, SamplingParams, StaticThreshold, generate
from dspark.runtime.tools.parity import greedy_match

pytestmark = pytest.mark.slow

PROMPTS = ["What is 17 times 23?", "Write a haiku about the sea."]


@pytest.mark.parametrize("scheduler", [FixedLength(), StaticThreshold(0.5)], ids=["fixed", "thr0.5"])
def test_greedy_identical_with_untrained_drafter(smollm2, scheduler):
    target, tok = smollm2.model, smollm2.tokenizer
    drafter = init_drafter(target, num_layers=1, block_size=4, markov_rank=32, markov_head_type="vanilla")
    params = SamplingParams(max_new_tokens=24, stop_token_ids=smollm2.stop_token_ids)
    for text in PROMPTS:
        prompt = list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              return_dict=True)["input_ids"])
        alone = generate(TorchBackend(target, None, 512), prompt, params, None)
        spec = generate(TorchBackend(target, drafter, 512), prompt, params, scheduler)
        match = greedy_match(alone.token_ids, spec.token_ids, reference_logits(target, prompt, alone.token_ids))
        assert match.ok, f"{text!r}: {match}"
        assert len(alone.token_ids) > 5
