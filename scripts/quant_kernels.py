"""Which quantized MatMul keeps verification cheap on ONNX Runtime's CPU provider?

Builds, for each candidate form, the linear part of one SmolLM2-135M decode step on random
weights: `--layers` layers of qkv [d, (H+2Hkv)D], o [d, d], gate_up [d, 2I], down [I, d]
(with the graph's residual adds and RMSNorms between them) and the LM head [d, V]. Each is
timed at M = 1, 2, 4, 8, 16 query rows; SPS(M) = 1 / seconds per call. Candidates are timed
interleaved (every candidate and M once per round, `--rounds` rounds, median kept), so a slow
phase of a shared machine falls on all alike; the spread across rounds is printed as the
disturbance. Attention and the KV cache are left out: they are the same for every candidate.

Also printed per candidate, on one gate_up layer alone: its relative error against x·W in
fp32 (weight and activation rounding together), and its row coupling: row 0's output when the
other 15 rows of the batch are 100x larger, against row 0 alone (a per-tensor activation scale
shows up here; it breaks "a request's output does not depend on its batch"; ~1e-7 is the M = 1
and M > 1 kernels rounding differently).

Sessions do not spin-wait between calls (`allow_spinning` 0): on a shared machine a spinning
pool of the previous candidate would slow the next one's first calls.

    python scripts/quant_kernels.py --threads 2 --rounds 5
"""
from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

from gguf import GGMLQuantizationType, quants

from dspark.export.ort_graph import Builder, block_matmul
from dspark.export.quant import from_q4_1, quantize_rtn, split_blocks

MS = "com.microsoft"
D_MODEL, QKV, INTER, VOCAB = 576, 960, 1536, 49152  # SmolLM2-135M
ROWS = (1, 2, 4, 8, 16)


Linear = Callable[[Builder, str, np.ndarray, str], str]  # (graph, x [M, K], W [K, N], name) -> y [M, N]


def fp32(g: Builder, x: str, w: np.ndarray, name: str) -> str:
    return g.op("MatMul", [x, g.weight(f"{name}.w", w)], name)


def nbits(bits: int, block: int, acc: int) -> Linear:
    """MatMulNBits, symmetric, round-to-nearest weights."""
    def lin(g: Builder, x: str, w: np.ndarray, name: str) -> str:
        return block_matmul(g, x, quantize_rtn(w, bits, block), name, accuracy_level=acc)
    return lin


def gguf_q4_1(block: int) -> Linear:
    """W quantized by the gguf package's Q4_1, repacked: symmetric MatMulNBits + the minimum term,
    in blocks of `block` (32: GGUF's own; 16: each block split in two, the same weights)."""
    def lin(g: Builder, x: str, w: np.ndarray, name: str) -> str:
        raw = quants.quantize(np.ascontiguousarray(w.T), GGMLQuantizationType.Q4_1)
        return block_matmul(g, x, split_blocks(from_q4_1(raw, w.shape[0]), block), name)
    return lin


def per_channel_int8(w: np.ndarray, qmax: int = 127) -> tuple[np.ndarray, np.ndarray]:
    scale = np.abs(w).max(0) / qmax  # [N]
    return np.clip(np.rint(w / scale), -qmax, qmax).astype(np.int8), scale.astype(np.float32)


def w8a8_row(g: Builder, x: str, w: np.ndarray, name: str) -> str:
    """int8 weights per channel (7-bit range: no int16 saturation in AVX2's u8·s8 kernel), uint8
    activations with one scale per row and the constant zero point 128: QuantizeLinear (axis 0)
    -> MatMulInteger (ONNX Runtime's prepacked u8s8 kernel; s8s8 is not prepacked and ~100x
    slower) -> rescale by row scale x column scale."""
    wq, ws = per_channel_int8(w, 63)
    amax = g.op("ReduceMax", [g.op("Abs", [x], f"{name}_abs"), g.weight(f"{name}.ax", np.array([-1], np.int64))],
                f"{name}_amax", keepdims=1)  # [M, 1]
    s = g.op("Div", [g.op("Max", [amax, g.weight(f"{name}.eps", np.float32(1e-12))], f"{name}_amax1"),
                     g.weight(f"{name}.127", np.float32(127))], f"{name}_s")
    s1 = g.op("Reshape", [s, g.weight(f"{name}.flat", np.array([-1], np.int64))], f"{name}_s1")  # [M]
    zp = g.op("Expand", [g.weight(f"{name}.128", np.array([128], np.uint8)), g.op("Shape", [s1], f"{name}_m")],
              f"{name}_zp")  # [M]
    xq = g.op("QuantizeLinear", [x, s1, zp], f"{name}_xq", axis=0)
    y = g.op("MatMulInteger", [xq, g.weight(f"{name}.q", wq), g.weight(f"{name}.zp", np.uint8(128))], f"{name}_i32")
    y = g.op("Mul", [g.op("Cast", [y], f"{name}_f", to=TP.FLOAT), s], f"{name}_r")
    return g.op("Mul", [y, g.weight(f"{name}.ws", ws)], name)


def dynamic_per_tensor(g: Builder, x: str, w: np.ndarray, name: str) -> str:
    """DynamicQuantizeMatMul: one activation scale per call (couples rows; a reference only)."""
    wq, ws = per_channel_int8(w)
    return g.op("DynamicQuantizeMatMul", [x, g.weight(f"{name}.q", wq), g.weight(f"{name}.ws", ws)], name, domain=MS)


def qdq_int4(block: int) -> Linear:
    """Signed int4 DequantizeLinear (blocked along K, no zero point) -> MatMul: the portable form,
    which ONNX Runtime fuses into MatMulNBits."""
    def lin(g: Builder, x: str, w: np.ndarray, name: str) -> str:
        K, N = w.shape
        bw = quantize_rtn(w, 4, block)
        signed = bw.codes().astype(np.int64) - 8  # [N, K/block, block]
        q = signed.reshape(N, -1)[:, :K].T  # [K, N]
        g.inits.append(helper.make_tensor(f"{name}.q", TP.INT4, [K, N], q.flatten().tolist()))
        dq = g.op("DequantizeLinear", [f"{name}.q", g.weight(f"{name}.s", np.ascontiguousarray(bw.scales.T))],
                  f"{name}_dq", axis=0, block_size=block)
        return g.op("MatMul", [x, dq], name)
    return lin


def qdq_int8_channel(g: Builder, x: str, w: np.ndarray, name: str) -> str:
    wq, ws = per_channel_int8(w)
    dq = g.op("DequantizeLinear", [g.weight(f"{name}.q", wq), g.weight(f"{name}.s", ws)], f"{name}_dq", axis=1)
    return g.op("MatMul", [x, dq], name)


@dataclass
class Candidate:
    name: str
    body: Linear
    head: Linear  # the LM head
    opset: int = 21


CANDIDATES = [
    Candidate("fp32 MatMul", fp32, fp32),
    Candidate("NBits 4-bit b32 acc4 (head 8-bit b32)", nbits(4, 32, 4), nbits(8, 32, 4)),
    Candidate("GGUF Q4_1 repacked: NBits 4-bit b32 acc4 + minimum term (head 8-bit)", gguf_q4_1(32), nbits(8, 32, 4)),
    Candidate("GGUF Q4_1 as b16: NBits 4-bit b16 acc4 + minimum term (head 8-bit b32)", gguf_q4_1(16),
              nbits(8, 32, 4)),
    Candidate("NBits 4-bit b16 acc4 (head 8-bit b16)", nbits(4, 16, 4), nbits(8, 16, 4)),
    Candidate("NBits 4-bit b64 acc4 (head 8-bit b64)", nbits(4, 64, 4), nbits(8, 64, 4)),
    Candidate("NBits 4-bit b128 acc4 (head 8-bit b64)", nbits(4, 128, 4), nbits(8, 64, 4)),
    Candidate("NBits 4-bit b32 acc1 (head 8-bit acc1)", nbits(4, 32, 1), nbits(8, 32, 1)),
    Candidate("NBits 4-bit b32 acc0 (head 8-bit acc0)", nbits(4, 32, 0), nbits(8, 32, 0)),
    Candidate("NBits 8-bit b32 acc4", nbits(8, 32, 4), nbits(8, 32, 4)),
    Candidate("NBits 8-bit b64 acc4", nbits(8, 64, 4), nbits(8, 64, 4)),
    Candidate("NBits 8-bit b32 acc1", nbits(8, 32, 1), nbits(8, 32, 1)),
    Candidate("W8A8 per-row u8s8: QuantizeLinear + MatMulInteger", w8a8_row, w8a8_row),
    Candidate("QDQ int4 b32 -> MatMul (head QDQ int8/channel)", qdq_int4(32), qdq_int8_channel),
    Candidate("QDQ int8/channel -> MatMul", qdq_int8_channel, qdq_int8_channel),
    Candidate("DynamicQuantizeMatMul, per-tensor (forbidden)", dynamic_per_tensor, dynamic_per_tensor),
]


def random_weights(layers: int, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    rng = np.random.default_rng(seed)
    w = lambda k, n: rng.normal(0, 1 / np.sqrt(k), (k, n)).astype(np.float32)  # noqa: E731
    blocks = [{"qkv": w(D_MODEL, QKV), "o": w(D_MODEL, D_MODEL), "gate_up": w(D_MODEL, 2 * INTER),
               "down": w(INTER, D_MODEL)} for _ in range(layers)]
    return blocks, w(D_MODEL, VOCAB)


def build(c: Candidate, blocks: list[dict[str, np.ndarray]], head: np.ndarray) -> onnx.ModelProto:
    """x [M, d] -> logits [M, V] through the layers' linear maps."""
    g = Builder()
    norm = g.weight("norm_w", np.ones(D_MODEL, np.float32))
    h = "x"
    for i, b in enumerate(blocks):
        qkv = c.body(g, h, b["qkv"], f"qkv{i}")
        att = g.op("Slice", [qkv, g.weight(f"s0_{i}", np.array([0], np.int64)),
                             g.weight(f"s1_{i}", np.array([D_MODEL], np.int64)),
                             g.weight(f"ax_{i}", np.array([1], np.int64))], f"att{i}")  # stands in for attention
        o = c.body(g, att, b["o"], f"o{i}")
        g.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [o, h, norm], [f"hn{i}", "", "", f"r{i}"],
                                        name=f"ln{i}", domain=MS, epsilon=1e-5))
        gu = c.body(g, f"hn{i}", b["gate_up"], f"gu{i}")
        g.nodes.append(helper.make_node("Split", [gu], [f"gate{i}", f"up{i}"], name=f"split{i}", axis=-1,
                                        num_outputs=2))
        act = g.op("Mul", [g.op("QuickGelu", [f"gate{i}"], f"silu{i}", domain=MS, alpha=1.0), f"up{i}"], f"act{i}")
        m = c.body(g, act, b["down"], f"down{i}")
        g.nodes.append(helper.make_node("SkipSimplifiedLayerNormalization", [m, f"r{i}", norm],
                                        [f"h{i + 1}", "", "", f"res{i + 1}"], name=f"ln2_{i}", domain=MS, epsilon=1e-5))
        h = f"h{i + 1}"
    c.head(g, h, head, "logits")
    graph = helper.make_graph(g.nodes, "kernels", [helper.make_tensor_value_info("x", TP.FLOAT, ["M", D_MODEL])],
                              [helper.make_tensor_value_info("logits", TP.FLOAT, ["M", VOCAB])], g.inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", c.opset), helper.make_opsetid(MS, 1)])


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def fused_ops(sess_model: onnx.ModelProto, threads: int) -> str:
    """The op types left after ONNX Runtime's optimizations (shows whether a QDQ pattern fused)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.log_severity_level = 3
    path = f"/tmp/quant_kernels_opt_{os.getpid()}.onnx"
    so.optimized_model_filepath = path
    ort.InferenceSession(sess_model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    ops = sorted({n.op_type for n in onnx.load(path, load_external_data=False).graph.node} - {
        "Slice", "SkipSimplifiedLayerNormalization", "Split", "QuickGelu", "Mul"})
    os.remove(path)
    for f in os.listdir("/tmp"):
        if f.startswith(f"quant_kernels_opt_{os.getpid()}"):
            os.remove(os.path.join("/tmp", f))
    return "+".join(ops)


def one_layer(c: Candidate, w: np.ndarray) -> tuple[float, float]:
    """(relative error against x·W in fp32, row coupling) of `c` on the weight w alone."""
    g = Builder()
    c.body(g, "x", w, "y")
    graph = helper.make_graph(g.nodes, "one", [helper.make_tensor_value_info("x", TP.FLOAT, ["M", w.shape[0]])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, ["M", w.shape[1]])], g.inits)
    s = session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", c.opset), helper.make_opsetid(MS, 1)]), 1)
    x = np.random.default_rng(2).normal(0, 1, (16, w.shape[0])).astype(np.float32)
    ref, out = x @ w, s.run(None, {"x": x})[0]
    solo = s.run(None, {"x": x[:1]})[0][0]
    batched = s.run(None, {"x": np.concatenate([x[:1], 100 * x[1:]])})[0][0]
    return (float(np.abs(out - ref).max() / np.abs(ref).max()),
            float(np.abs(solo - batched).max() / np.abs(solo).max()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5, help="calls per (candidate, M) per round; the median is kept")
    ap.add_argument("--only", default="", help="comma-separated substrings of candidate names")
    args = ap.parse_args()
    cands = [c for c in CANDIDATES if not args.only or any(s in c.name for s in args.only.split(","))]
    blocks, head = random_weights(args.layers)
    rng = np.random.default_rng(1)
    xs = {m: rng.normal(0, 1, (m, D_MODEL)).astype(np.float32) for m in ROWS}
    sessions = {}
    for c in cands:
        model = build(c, blocks, head)
        sessions[c.name] = session(model, args.threads)
        err, coupling = one_layer(c, blocks[0]["gate_up"])
        print(f"{c.name}: ops {fused_ops(model, args.threads)}; gate_up error {err:.4f}; "
              f"row coupling {coupling:.1e}", flush=True)
    times = {(c.name, m): [] for c in cands for m in ROWS}
    load0 = os.getloadavg()
    for r in range(args.rounds):
        order = cands if r % 2 == 0 else cands[::-1]
        for c in order:
            for m in ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]:
                s, feed = sessions[c.name], {"x": xs[m]}
                s.run(None, feed)
                ts = []
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    s.run(None, feed)
                    ts.append(time.perf_counter() - t0)
                times[(c.name, m)].append(float(np.median(ts)))
    spread = [max(v) / min(v) for v in times.values()]
    print(f"\nthreads {args.threads}, layers {args.layers}, rounds {args.rounds} x reps {args.reps}; "
          f"load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f}; disturbance: per-cell "
          f"max/min over rounds median {np.median(spread):.2f}, worst {max(spread):.2f}\n")
    print("| candidate | " + " | ".join(f"SPS({m})" for m in ROWS) + " | cost of 8 rows in steps |")
    print("|---|" + "---|" * (len(ROWS) + 1))
    for c in cands:
        t = {m: float(np.median(times[(c.name, m)])) for m in ROWS}
        print(f"| {c.name} | " + " | ".join(f"{1 / t[m]:.1f}" for m in ROWS) + f" | {t[8] / t[1]:.2f} |")


if __name__ == "__main__":
    main()
