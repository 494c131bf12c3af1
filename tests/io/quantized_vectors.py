#!/usr/bin/python3
"""Test vectors for GPTQ and AWQ packing, written from the formats' description (the AutoGPTQ /
AutoAWQ layouts as transformers loads them) with numpy, independently of memtune's C++:

    /usr/bin/python3 tests/io/quantized_vectors.py OUT_DIR
    /usr/bin/python3 tests/io/quantized_vectors.py --check QUANTIZED_DIR FLOAT_DIR

The second form reads a quantized checkpoint (config.json + model.safetensors) with its own
safetensors parser, dequantizes every packed layer by the formulas above, and compares it with
FLOAT_DIR's float32 weights (exit 1 on a difference, a NaN or an infinity on either side, or a
tensor missing on either side).

For each case, OUT_DIR/<case>.json gives the shapes and OUT_DIR/<case>.<array>.bin the arrays
(little-endian): q and zeros (uint8 codes), scales (float16), g_idx (int32, GPTQ), the packed
qweight and qzeros (int32) and the dequantized weight w [in, out] (float32).
"""
import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from numeric import NumericMismatch, assert_close  # noqa: E402

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def gptq_pack(q, zeros, bits):
    """qweight [in*bits/32, out]: word r holds input rows r*(32/bits)+j at bit offset bits*j.
    qzeros [groups, out*bits/32]: word c holds output columns c*(32/bits)+j, each stored as zero-1."""
    per = 32 // bits
    rows, cols = q.shape
    qweight = np.zeros((rows // per, cols), dtype=np.uint32)
    for j in range(per):
        qweight |= q[j::per, :].astype(np.uint32) << np.uint32(bits * j)
    stored = (zeros.astype(np.int64) - 1) & ((1 << bits) - 1)
    qzeros = np.zeros((zeros.shape[0], cols // per), dtype=np.uint32)
    for j in range(per):
        qzeros |= stored[:, j::per].astype(np.uint32) << np.uint32(bits * j)
    return qweight.view(np.int32), qzeros.view(np.int32)


def awq_pack(codes):
    """[rows, out] 4-bit codes -> [rows, out/8] words: nibble i of word c is column 8c + AWQ_ORDER[i]."""
    rows, cols = codes.shape
    words = np.zeros((rows, cols // 8), dtype=np.uint32)
    for i, column in enumerate(AWQ_ORDER):
        words |= codes[:, column::8].astype(np.uint32) << np.uint32(4 * i)
    return words.view(np.int32)


def write(out_dir, name, meta, arrays):
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(meta, f)
    for key, array in arrays.items():
        array.tofile(os.path.join(out_dir, f"{name}.{key}.bin"))


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(7)
    cases = [("gptq4", 4, 64, 24, 16, False), ("gptq8", 8, 48, 20, 16, True), ("gptq4_actorder", 4, 32, 16, 8, True)]
    for name, bits, rows, cols, group, act_order in cases:
        groups = rows // group
        q = rng.integers(0, 1 << bits, size=(rows, cols), dtype=np.uint8)
        zeros = rng.integers(1, 1 << bits, size=(groups, cols), dtype=np.uint8)  # zero - 1 must fit
        scales = (rng.random((groups, cols)) * 0.02 + 0.001).astype(np.float16)
        g_idx = np.arange(rows, dtype=np.int32) // group
        if act_order:  # desc_act: an arbitrary assignment of rows to groups
            g_idx = rng.permutation(g_idx).astype(np.int32)
        qweight, qzeros = gptq_pack(q, zeros, bits)
        w = scales.astype(np.float32)[g_idx] * (q.astype(np.float32) - zeros.astype(np.float32)[g_idx])
        write(out_dir, name, {"bits": bits, "in": rows, "out": cols, "groups": groups},
              {"q": q, "zeros": zeros, "scales": scales, "g_idx": g_idx, "qweight": qweight, "qzeros": qzeros,
               "w": w.astype(np.float32)})
    rows, cols, group = 64, 32, 16
    groups = rows // group
    q = rng.integers(0, 16, size=(rows, cols), dtype=np.uint8)
    zeros = rng.integers(0, 16, size=(groups, cols), dtype=np.uint8)
    scales = (rng.random((groups, cols)) * 0.02 + 0.001).astype(np.float16)
    g = np.arange(rows) // group
    w = scales.astype(np.float32)[g] * (q.astype(np.float32) - zeros.astype(np.float32)[g])
    write(out_dir, "awq4", {"bits": 4, "in": rows, "out": cols, "groups": groups, "group_size": group},
          {"q": q, "zeros": zeros, "scales": scales, "qweight": awq_pack(q), "qzeros": awq_pack(zeros),
           "w": w.astype(np.float32)})


def read_safetensors(path):
    dtypes = {"F32": np.float32, "F16": np.float16, "I32": np.int32}
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        begin, end = t["data_offsets"]
        if t["dtype"] == "BF16":
            raw = np.frombuffer(data[8 + n + begin:8 + n + end], dtype=np.uint16).astype(np.uint32) << 16
            out[name] = raw.view(np.float32).reshape(t["shape"])
        else:
            out[name] = np.frombuffer(data[8 + n + begin:8 + n + end], dtype=dtypes[t["dtype"]]).reshape(t["shape"])
    return out


def unpack_rows(words, bits):
    """GPTQ qweight [in*bits/32, out] -> codes [in, out]."""
    per = 32 // bits
    w = words.view(np.uint32)
    return np.stack([(w >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1) for j in range(per)], axis=1).reshape(
        w.shape[0] * per, w.shape[1])


def unpack_cols(words, bits):
    """GPTQ qzeros [groups, out*bits/32] -> [groups, out]."""
    per = 32 // bits
    w = words.view(np.uint32)
    return np.stack([(w >> np.uint32(bits * j)) & np.uint32((1 << bits) - 1) for j in range(per)], axis=2).reshape(
        w.shape[0], w.shape[1] * per)


def awq_unpack(words):
    w = words.view(np.uint32)
    out = np.zeros((w.shape[0], w.shape[1] * 8), dtype=np.uint32)
    for i, column in enumerate(AWQ_ORDER):
        out[:, column::8] = (w >> np.uint32(4 * i)) & np.uint32(15)
    return out


def check(quantized_dir, float_dir):
    config = json.load(open(os.path.join(quantized_dir, "config.json")))["quantization_config"]
    q = read_safetensors(os.path.join(quantized_dir, "model.safetensors"))
    f = read_safetensors(os.path.join(float_dir, "model.safetensors"))
    bits, group = config["bits"], config["group_size"]
    checked = 0
    for name, ref in f.items():
        base = name[:-len(".weight")] if name.endswith(".weight") else None
        if base is None or base + ".qweight" not in q:
            if name not in q or not np.array_equal(q[name].astype(np.float32), ref.astype(np.float32)):
                sys.exit(f"{name}: not copied unchanged")
            continue
        scales = q[base + ".scales"].astype(np.float32)
        if config["quant_method"] == "gptq":
            # A packed head ("lm_head": true) has its own width where "lm_head_bits" says so.
            b = config.get("lm_head_bits", bits) if base == "lm_head" else bits
            codes = unpack_rows(q[base + ".qweight"], b).astype(np.float32)
            zeros = unpack_cols(q[base + ".qzeros"], b).astype(np.float32) + 1
            g = q[base + ".g_idx"].astype(np.int64)
        else:
            codes = awq_unpack(q[base + ".qweight"]).astype(np.float32)
            zeros = awq_unpack(q[base + ".qzeros"]).astype(np.float32)
            g = np.arange(codes.shape[0]) // group
        w = scales[g] * (codes - zeros[g])  # [in, out]
        try:
            assert_close(w.T, ref.astype(np.float32), atol=0.0, rtol=0.0, what=f"{name}: dequantized [out, in]")
        except NumericMismatch as e:
            sys.exit(str(e))
        checked += 1
    if checked == 0:
        sys.exit("no quantized layer found")
    print(f"{checked} quantized layers equal")


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        check(sys.argv[2], sys.argv[3])
    else:
        main(sys.argv[1])
