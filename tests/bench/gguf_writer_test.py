#!/usr/bin/python3
"""bench/gguf_writer.py against the GGUF format read back here from its specification. Two small
Qwen2 checkpoints (bfloat16, q/k/v biases) and a small BPE tokenizer, each written as f16, q8_0
and q4_0:
  - "tied": lm_head shares the embedding, so the file has no output.weight; every row length is a
    multiple of 32 (Q8_0 / Q4_0's block).
  - "untied": a separate lm_head.weight, written as output.weight (Q8_0 in the q4_0 file, where
    token_embd then stays Q4_0), and intermediate_size 80, so mlp.down_proj's rows (80 values)
    are not a multiple of 32: those cannot be cut into blocks and must stay float16, as the
    Hugging Face converter does, in every file type.
Checks the header, the metadata the comparison relies on, every tensor's name, shape, type and
aligned offset; every block's float16 scale against the format's definition computed here in
float32 (Q8_0: d = max|x| / 127; Q4_0: d = m / -8 for m the value of largest magnitude, sign
kept, the first one on ties), bit for bit; and that each value dequantizes to the checkpoint's
within half a step of its block (f16: within float16 rounding). A NaN or infinity on either side
fails. Also that a GPTQ checkpoint is refused."""
import argparse
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from numeric import NumericMismatch, assert_close, check, difference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRITER = os.path.join(ROOT, "bench", "gguf_writer.py")
H, V, L = 64, 40, 2
QK = 32
F32, F16, Q4_0, Q8_0 = 0, 1, 2, 8
MODELS = {"tied": {"tied": True, "intermediate": 96}, "untied": {"tied": False, "intermediate": 80}}
FIXED_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
               "lm_head.weight": "output.weight"}
LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
               "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
               "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
               "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
               "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}


def write_checkpoint(d, tied, inter, seed):
    os.makedirs(d, exist_ok=True)
    config = {"model_type": "qwen2", "hidden_size": H, "intermediate_size": inter, "num_hidden_layers": L,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V, "rope_theta": 1e6,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": tied,
              "eos_token_id": 30}
    json.dump(config, open(os.path.join(d, "config.json"), "w"))
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not tied:
        shapes["lm_head.weight"] = (V, H)
    for l in range(L):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (H, H), p + "self_attn.q_proj.bias": (H,),
                       p + "self_attn.k_proj.weight": (32, H), p + "self_attn.k_proj.bias": (32,),
                       p + "self_attn.v_proj.weight": (32, H), p + "self_attn.v_proj.bias": (32,),
                       p + "self_attn.o_proj.weight": (H, H), p + "mlp.gate_proj.weight": (inter, H),
                       p + "mlp.up_proj.weight": (inter, H), p + "mlp.down_proj.weight": (H, inter)})
    values, header, blobs, offset = {}, {}, [], 0
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        bits = (x.view(np.uint32) >> 16).astype("<u2")  # bfloat16 by truncation
        values[name] = (bits.astype(np.uint32) << 16).view(np.float32)
        blob = bits.tobytes()
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    vocab = {chr(ord("a") + i): i for i in range(26)}
    vocab.update({"ab": 26, "abc": 27})
    tokenizer = {"model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "ab c"]},
                 "added_tokens": [{"id": 30, "content": "<|endoftext|>", "special": True}]}
    json.dump(tokenizer, open(os.path.join(d, "tokenizer.json"), "w"))
    return values


class Reader:
    """GGUF v3 from the specification: header, metadata, tensor infos, aligned data."""

    def __init__(self, path):
        self.b = open(path, "rb").read()
        self.p = 0
        magic, version, n_tensors, n_kv = self.take("<4sIQQ")
        check(magic == b"GGUF" and version == 3, f"{path}: magic {magic!r}, version {version}; expected GGUF v3")
        self.kv = {}
        for _ in range(n_kv):
            key = self.string()
            (vtype,) = self.take("<I")
            self.kv[key] = self.value(vtype)
        self.tensors = {}
        for _ in range(n_tensors):
            name = self.string()
            (dims,) = self.take("<I")
            ne = self.take(f"<{dims}Q")
            ggml_type, off = self.take("<IQ")
            self.tensors[name] = (tuple(reversed(ne)), ggml_type, off)
        align = self.kv.get("general.alignment", 32)
        self.data = self.p + (-self.p % align)
        self.align = align

    def take(self, fmt):
        out = struct.unpack_from(fmt, self.b, self.p)
        self.p += struct.calcsize(fmt)
        return out

    def string(self):
        (n,) = self.take("<Q")
        s = self.b[self.p:self.p + n].decode()
        self.p += n
        return s

    def value(self, vtype):
        scalar = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                  12: "<d"}
        if vtype == 8:
            return self.string()
        if vtype == 9:
            elem, n = self.take("<IQ")
            return [self.value(elem) for _ in range(n)]
        return self.take(scalar[vtype])[0]

    def dequantize(self, name):
        """(values as float32 in the tensor's shape, the float16 scale of each block [blocks] or None,
        each value's step |d| in the tensor's shape or None)."""
        shape, t, off = self.tensors[name]
        n = int(np.prod(shape))
        at = self.data + off
        if t == F32:
            return np.frombuffer(self.b, "<f4", n, at).reshape(shape), None, None
        if t == F16:
            return np.frombuffer(self.b, "<f2", n, at).astype(np.float32).reshape(shape), None, None
        size = {Q8_0: 2 + QK, Q4_0: 2 + QK // 2}[t]
        raw = np.frombuffer(self.b, np.uint8, n // QK * size, at).reshape(-1, size)
        d16 = raw[:, :2].copy().view("<f2")  # [blocks, 1]
        d = d16.astype(np.float32)
        if t == Q8_0:  # d, 32 int8
            q = raw[:, 2:].view(np.int8).astype(np.float32)
        else:  # Q4_0: d, low nibbles are values 0..15, high nibbles 16..31, offset 8
            q = np.concatenate([raw[:, 2:] & 15, raw[:, 2:] >> 4], axis=1).astype(np.float32) - 8
        return (d * q).reshape(shape), d16[:, 0], np.abs(d).repeat(QK, axis=1).reshape(shape)


def definition_scales(x, t):
    """The format's block scale of each QK-value block of x's rows, in float32 then rounded to
    float16 as stored: Q8_0 d = max|x| / 127; Q4_0 d = m / -8, m the block's value of largest
    magnitude with its sign (the first of equal magnitudes)."""
    blocks = x.astype(np.float32).reshape(-1, QK)
    if t == Q8_0:
        d = np.max(np.abs(blocks), axis=1) / np.float32(127)
    else:
        m = blocks[np.arange(len(blocks)), np.argmax(np.abs(blocks), axis=1)]
        d = m / np.float32(-8)
    return d.astype(np.float32).astype(np.float16)


def expected_type(kind, tied, name, shape):
    if len(shape) == 1:
        return F32
    if kind == "f16" or shape[-1] % QK:  # a row that is not whole blocks stays float16
        return F16
    if kind == "q8_0" or name == "output.weight" or (tied and name == "token_embd.weight"):
        return Q8_0
    return Q4_0


def gguf_name(hf):
    if hf in FIXED_NAMES:
        return FIXED_NAMES[hf]
    parts = hf.split(".")
    return f"blk.{parts[2]}.{LAYER_NAMES['.'.join(parts[3:])]}"


def within_bound(got, want, bound):
    """None if |got - want| <= bound everywhere with both finite, else what is wrong (a NaN or an
    infinity in either operand fails; the worst element relative to its bound is named)."""
    d = difference(got, want)
    if d.problem:
        return d.problem
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    if np.all(err <= bound):
        return None
    k = np.unravel_index(int(np.argmax(err - bound)), err.shape)
    k = tuple(int(i) for i in k)
    return (f"{int(np.sum(~(err <= bound)))} values beyond the bound; worst at index {k}: got {got[k]:.9g}, "
            f"want {want[k]:.9g}, |diff| {err[k]:.6g} > tolerance {bound[k]:.6g}")


def check_file(model, kind, g, values, inter, tied):
    failures = []
    expect = {"general.architecture": "qwen2", "qwen2.embedding_length": H, "qwen2.block_count": L,
              "qwen2.feed_forward_length": inter, "qwen2.attention.head_count": 4,
              "qwen2.attention.head_count_kv": 2, "tokenizer.ggml.model": "gpt2",
              "tokenizer.ggml.eos_token_id": 30}
    for key, want in expect.items():
        if g.kv.get(key) != want:
            failures.append(f"{key} = {g.kv.get(key)!r}, expected {want!r}")
    tokens = g.kv["tokenizer.ggml.tokens"]
    if len(tokens) != V or tokens[27] != "abc" or tokens[35] != "[PAD35]":
        failures.append(f"token list {tokens[25:36]} of {len(tokens)}")
    if g.kv["tokenizer.ggml.merges"] != ["a b", "ab c"]:
        failures.append(f"merges {g.kv['tokenizer.ggml.merges']}")
    want_names = {gguf_name(hf) for hf in values}
    if set(g.tensors) != want_names:
        failures.append(f"tensors {sorted(set(g.tensors) ^ want_names)} differ from the checkpoint's "
                        f"({'tied: no output.weight' if tied else 'untied: output.weight from lm_head.weight'})")
    seen = set()
    for hf, x in values.items():
        name = gguf_name(hf)
        if name not in g.tensors:
            continue
        shape, t, off = g.tensors[name]
        if shape != x.shape or off % g.align:
            failures.append(f"{name} shape {shape} offset {off}, expected {x.shape}, aligned")
            continue
        want_t = expected_type(kind, tied, name, x.shape)
        if t != want_t:
            failures.append(f"{name} has type {t}, expected {want_t}")
            continue
        seen.add(t)
        got, scales, step = g.dequantize(name)
        if scales is not None:
            try:
                assert_close(scales, definition_scales(x, t), atol=0.0, rtol=0.0,
                             what=f"{name}: float16 block scales (index: block) against the definition "
                                  f"{'max|x| / 127' if t == Q8_0 else 'm / -8'}")
            except NumericMismatch as e:
                failures.append(str(e))
        # Half a step of the block's float16 scale, plus that scale's own float16 rounding
        # times the largest code (128); Q4_0's codes reach -8 d .. 7 d with d = m / -8, so a
        # value near -m takes a whole step. f16 and f32 weights: float16 rounding of the value.
        if step is None:
            bound = (2.0 ** -11) * np.abs(x) + 1e-7
        else:
            clamped = (t == Q4_0) & (np.abs(x) > 7.5 * step)
            bound = step * (np.where(clamped, 1.0, 0.5) + 128 * 2.0 ** -11)
        problem = within_bound(got, x, bound)
        if problem:
            failures.append(f"{name} (type {t}): {problem}")
    # The q4_0 file holds every type the model can give: Q4_0, the Q8_0 head, float32 1-D tensors,
    # and float16 where a row is not whole blocks.
    if kind == "q4_0" and seen != {F32, Q4_0, Q8_0} | ({F16} if inter % QK else set()):
        failures.append(f"tensor types {seen}")
    return [f"{model} {kind}: {f}" for f in failures]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    work = parser.parse_args().workdir
    failures = []
    for seed, (model_name, spec) in enumerate(MODELS.items(), start=3):
        model = os.path.join(work, f"model-{model_name}")
        values = write_checkpoint(model, spec["tied"], spec["intermediate"], seed)
        for kind in ("f16", "q8_0", "q4_0"):
            out = os.path.join(work, f"model-{model_name}-{kind}.gguf")
            subprocess.run([sys.executable, WRITER, "--model", model, "--type", kind, "--out", out], check=True)
            failures += check_file(model_name, kind, Reader(out), values, spec["intermediate"], spec["tied"])
    # A GPTQ checkpoint is refused with the file and field named, and nothing is written.
    model = os.path.join(work, "model-tied")
    config = json.load(open(os.path.join(model, "config.json")))
    config["quantization_config"] = {"quant_method": "gptq"}
    json.dump(config, open(os.path.join(model, "config.json"), "w"))
    out = os.path.join(work, "refused.gguf")
    r = subprocess.run([sys.executable, WRITER, "--model", model, "--type", "q4_0", "--out", out],
                       capture_output=True, text=True)
    if r.returncode == 0 or "config.json" not in r.stderr or "gptq" not in r.stderr or os.path.exists(out):
        failures.append(f"a GPTQ checkpoint: rc {r.returncode}, {r.stderr.strip()!r}")
    for f in failures:
        print("FAIL", f)
    print("gguf_writer:", "ok" if not failures else f"{len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
