#!/usr/bin/python3
"""bench/gguf_writer.py against the GGUF format read back here from its specification: a small
Qwen2 checkpoint (bfloat16, tied, q/k/v biases) and a small BPE tokenizer, written as f16, q8_0
and q4_0. Checks the header, the metadata the comparison relies on, every tensor's name, shape,
type and aligned offset, and that each block dequantizes to the checkpoint's values within half a
quantization step (f16: within float16 rounding). Also that a GPTQ checkpoint is refused."""
import argparse
import json
import os
import struct
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRITER = os.path.join(ROOT, "bench", "gguf_writer.py")
H, I, V, L = 64, 96, 40, 2


def write_checkpoint(d):
    os.makedirs(d, exist_ok=True)
    config = {"model_type": "qwen2", "hidden_size": H, "intermediate_size": I, "num_hidden_layers": L,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V, "rope_theta": 1e6,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": True,
              "eos_token_id": 30}
    json.dump(config, open(os.path.join(d, "config.json"), "w"))
    rng = np.random.default_rng(3)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    for l in range(L):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (H, H), p + "self_attn.q_proj.bias": (H,),
                       p + "self_attn.k_proj.weight": (32, H), p + "self_attn.k_proj.bias": (32,),
                       p + "self_attn.v_proj.weight": (32, H), p + "self_attn.v_proj.bias": (32,),
                       p + "self_attn.o_proj.weight": (H, H), p + "mlp.gate_proj.weight": (I, H),
                       p + "mlp.up_proj.weight": (I, H), p + "mlp.down_proj.weight": (H, I)})
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
        assert magic == b"GGUF" and version == 3, (magic, version)
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
        shape, t, off = self.tensors[name]
        n = int(np.prod(shape))
        at = self.data + off
        if t == 0:
            return np.frombuffer(self.b, "<f4", n, at).reshape(shape), None
        if t == 1:
            return np.frombuffer(self.b, "<f2", n, at).astype(np.float32).reshape(shape), None
        size = {8: 34, 2: 18}[t]
        raw = np.frombuffer(self.b, np.uint8, n // 32 * size, at).reshape(-1, size)
        d = raw[:, :2].copy().view("<f2").astype(np.float32)
        if t == 8:  # Q8_0: d, 32 int8
            q = raw[:, 2:].view(np.int8).astype(np.float32)
        else:  # Q4_0: d, low nibbles are values 0..15, high nibbles 16..31, offset 8
            q = np.concatenate([raw[:, 2:] & 15, raw[:, 2:] >> 4], axis=1).astype(np.float32) - 8
        return (d * q).reshape(shape), np.abs(d).repeat(32, axis=1).reshape(shape)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    work = parser.parse_args().workdir
    model = os.path.join(work, "model")
    values = write_checkpoint(model)
    failures = []
    for kind, types in (("f16", {1}), ("q8_0", {8}), ("q4_0", {2, 8})):
        out = os.path.join(work, f"model-{kind}.gguf")
        subprocess.run([sys.executable, WRITER, "--model", model, "--type", kind, "--out", out], check=True)
        g = Reader(out)
        expect = {"general.architecture": "qwen2", "qwen2.embedding_length": H, "qwen2.block_count": L,
                  "qwen2.feed_forward_length": I, "qwen2.attention.head_count": 4,
                  "qwen2.attention.head_count_kv": 2, "tokenizer.ggml.model": "gpt2",
                  "tokenizer.ggml.eos_token_id": 30}
        for key, want in expect.items():
            if g.kv.get(key) != want:
                failures.append(f"{kind}: {key} = {g.kv.get(key)!r}, expected {want!r}")
        tokens = g.kv["tokenizer.ggml.tokens"]
        if len(tokens) != V or tokens[27] != "abc" or tokens[35] != "[PAD35]":
            failures.append(f"{kind}: token list {tokens[25:36]} of {len(tokens)}")
        if g.kv["tokenizer.ggml.merges"] != ["a b", "ab c"]:
            failures.append(f"{kind}: merges {g.kv['tokenizer.ggml.merges']}")
        if "output.weight" in g.tensors or len(g.tensors) != len(values):
            failures.append(f"{kind}: {len(g.tensors)} tensors for {len(values)} (tied: no output.weight)")
        seen = set()
        for hf, x in values.items():
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}.get(hf)
            if name is None:
                l, rest = hf.split(".")[2], ".".join(hf.split(".")[3:])
                part = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
                        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
                        "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
                        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
                        "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
                        "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight"}[rest]
                name = f"blk.{l}.{part}"
            shape, t, off = g.tensors[name]
            if shape != x.shape or off % g.align:
                failures.append(f"{kind}: {name} shape {shape} offset {off}, expected {x.shape}, aligned")
                continue
            if x.ndim == 1:
                if t != 0:
                    failures.append(f"{kind}: 1-D {name} has type {t}, expected f32")
            elif t not in types:
                failures.append(f"{kind}: {name} has type {t}, expected one of {types}")
            seen.add(t)
            got, step = g.dequantize(name)
            # Half a step of the block's float16 scale, plus that scale's own float16 rounding
            # times the largest code (128); Q4_0's codes reach -8 d .. 7 d with d = max / -8, so a
            # value near -max takes a whole step. f16 and f32 weights: float16 rounding of the value.
            if step is None:
                bound = (2.0 ** -11) * np.abs(x) + 1e-7
            else:
                clamped = (t == 2) & (np.abs(x) > 7.5 * step)
                bound = step * (np.where(clamped, 1.0, 0.5) + 128 * 2.0 ** -11)
            worst = float(np.max(np.abs(got - x) - bound))
            if worst > 0:
                failures.append(f"{kind}: {name} off by {worst:.3g} beyond the bound")
        if kind == "q4_0" and seen != {0, 2, 8}:  # the tied head (token_embd) is Q8_0, the rest Q4_0
            failures.append(f"q4_0: tensor types {seen}")
    # A GPTQ checkpoint is refused with the file and field named, and nothing is written.
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
