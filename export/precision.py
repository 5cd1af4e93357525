"""`dspark export --precision`: which of the target's weights are block-quantized, and from what.

    fp32  the source's weights as loaded (a GGUF dequantized): today's bundle
    gguf  a GGUF's own blocks, repacked, not re-quantized (quant.from_q4_1 / from_q8_0)
    int8  every linear weight and the LM head: 8-bit, block 64, round-to-nearest
    int4  the layers' linear weights 4-bit, the LM head 8-bit; block 64, round-to-nearest
    auto  (the default) gguf for a .gguf source, fp32 for a float source

Why that default (docs/quantization.md, measured on the default GGUF): `gguf` decodes about 2x
faster than fp32 on the CPU, DSpark on it is lossless with respect to it, and it is the model as
shipped (what llama.cpp runs). A float source stays fp32 until int8/int4 are measured on a real
one (only tiny random models are on this machine).

(Block 64: ONNX Runtime's int8-activation kernel costs less per row than at 32,
docs/quantization.md; a GGUF keeps its own 32.)

The result maps a parameter name of TargetModel (`layers.0.self_attn.q_proj.weight`,
`lm_head.weight`) to the quantized W = weightᵀ [in, out]. `dequantize_into` writes the numbers
those weights stand for into the torch model, so the reference and every graph exported from it
hold the same weights; the ONNX Runtime graph (ort_graph.py) reads the blocks themselves."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dspark.runtime.errors import CheckpointError

from .quant import BlockWeight, from_q4_1, from_q8_0, quantize_rtn, take_n
from .target import TargetModel

PRECISIONS = ("fp32", "gguf", "int8", "int4")


def resolve(precision: str, source: Path) -> str:
    """`auto` made concrete for `source`; any other precision as given."""
    if precision == "auto":
        return "gguf" if source.suffix == ".gguf" else "fp32"
    return precision


RTN_BLOCK = 64
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
GGUF_REPACK = {"Q4_1": from_q4_1, "Q8_0": from_q8_0}
GGUF_FLOAT = ("F32", "F16", "BF16")  # kept as the source's floats


def linear_names(model: TargetModel) -> list[str]:
    return [f"layers.{i}.{n}.weight" for i in range(model.cfg.num_layers) for n in LINEARS] + ["lm_head.weight"]


def target_weights(model: TargetModel, source: Path, precision: str) -> dict[str, BlockWeight]:
    if precision not in PRECISIONS:
        raise CheckpointError(f"unknown precision {precision!r}; choose auto or one of {', '.join(PRECISIONS)}")
    is_gguf = source.suffix == ".gguf"
    if precision == "fp32":
        return {}
    if precision == "gguf":
        if not is_gguf:
            raise CheckpointError(f"--precision gguf needs a .gguf source; {source} is not one "
                                  f"(use --precision int8 or int4 to quantize it)")
        return gguf_weights(model, source)
    if is_gguf:
        raise CheckpointError(f"{source} is already quantized (GGUF): --precision {precision} would quantize its "
                              f"blocks a second time; use --precision gguf (its own blocks) or fp32")
    bits = 8 if precision == "int8" else 4
    params = dict(model.named_parameters(remove_duplicate=False))
    return {n: quantize_rtn(params[n].detach().float().T.numpy(), 8 if n == "lm_head.weight" else bits, RTN_BLOCK)
            for n in linear_names(model)}


def gguf_weights(model: TargetModel, source: Path) -> dict[str, BlockWeight]:
    """The GGUF's linear weights and LM head as they are stored. Rows of q/k are reordered as
    transformers reorders them when it loads the file (llama.cpp permutes them for its RoPE);
    the result is checked against the model transformers loaded."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(source)
    field = reader.fields["general.architecture"]
    arch = bytes(field.parts[field.data[0]]).decode()
    c = model.cfg
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
        config={"num_attention_heads": c.num_heads, "num_key_value_heads": c.num_kv_heads})
    names = {"token_embd.weight": "embed_tokens.weight", "output.weight": "lm_head.weight"}
    for i in range(c.num_layers):
        names.update({f"blk.{i}.{g}.weight": f"layers.{i}.{n}.weight" for g, n in GGUF_LINEARS.items()})
    tensors = {t.name: t for t in reader.tensors if t.name in names}
    if c.tie_word_embeddings:
        tensors.pop("output.weight", None)
    unhandled: dict[str, list[str]] = {}
    for t in tensors.values():
        kind = t.tensor_type.name
        if kind not in GGUF_REPACK and not (kind in GGUF_FLOAT and t.name != "token_embd.weight"):
            unhandled.setdefault(kind, []).append(t.name)
    if unhandled:
        listed = "; ".join(f"{kind}: {', '.join(n)}" for kind, n in unhandled.items())
        raise CheckpointError(f"{source}: --precision gguf handles {', '.join(GGUF_REPACK)} weights "
                              f"(and float layers); this file has {listed}. Use --precision fp32 (dequantized)")
    params = dict(model.named_parameters(remove_duplicate=False))
    out: dict[str, BlockWeight] = {}
    for gname, t in tensors.items():
        name = names[gname]
        if t.tensor_type.name in GGUF_FLOAT:
            continue
        if name == "embed_tokens.weight":
            if not c.tie_word_embeddings:
                continue  # an untied embedding is only gathered: it stays in floats
            name = "lm_head.weight"
        k = int(t.shape[0])  # ggml's ne0: the input features, along which blocks run
        w = GGUF_REPACK[t.tensor_type.name](np.asarray(t.data), k)
        order = np.asarray(processor.process(np.arange(w.shape[1]), gname).weights)
        w = take_n(w, order)
        loaded = params[name].detach().float().T.numpy()
        if not np.allclose(w.dequantize(), loaded, rtol=1e-5, atol=1e-6 * np.abs(loaded).max()):
            raise CheckpointError(f"{source}: {gname} repacked does not match transformers' dequantization")
        out[name] = w
    return out


def describe(weights: dict[str, BlockWeight]) -> dict[str, str]:
    """The formats, for the manifest: {"layers": "4-bit b32 + minimum", "lm_head": "8-bit b32"}."""
    fmt = lambda w: f"{w.bits}-bit b{w.block}" + (" + minimum" if w.offsets is not None else "")  # noqa: E731
    layers = sorted({fmt(w) for n, w in weights.items() if n != "lm_head.weight"})
    head = weights.get("lm_head.weight")
    return {"layers": ", ".join(layers) or "fp32", "lm_head": fmt(head) if head is not None else "fp32"}


def dequantize_into(model: TargetModel, weights: dict[str, BlockWeight]) -> None:
    """The torch model computes with the numbers the quantized weights stand for (a tied LM
    head sets the embedding too: one tensor)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, w in weights.items():
            params[name].copy_(torch.from_numpy(w.dequantize().T))
