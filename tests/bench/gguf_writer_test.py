"""bench/gguf_writer.py's files read back by `gguf`, the GGUF package llama.cpp publishes on PyPI.

    PY tests/bench/gguf_writer_test.py --workdir DIR

PY is the pinned Hugging Face environment (scripts/prepare-hf-env.sh; tools/hf-oracle/
requirements.txt pins gguf). Two small Qwen2 checkpoints (bfloat16, q/k/v biases) and a small BPE
tokenizer, each written as f16, q8_0 and q4_0:
  - "tied": lm_head shares the embedding, so the file has no output.weight; every row length is a
    multiple of 32 (Q8_0 / Q4_0's block).
  - "untied": a separate lm_head.weight, written as output.weight (Q8_0 in the q4_0 file, where
    token_embd then stays Q4_0), and intermediate_size 80, so mlp.down_proj's rows (80 values)
    are not a multiple of 32: those cannot be cut into blocks and must stay float16, as the
    Hugging Face converter does, in every file type.
And a small Qwen3-MoE checkpoint (4 experts, 2 a token; float32, its experts out of order in the
file) written as f16: llama.cpp's qwen3moe metadata (expert counts, key length), the router kept
float32, the q/k norms, and each layer's experts stacked in id order into [experts, rows, cols]
tensors whose slices are the experts' values.
gguf.GGUFReader opens each file, and what is checked comes from the package, not from the writer:
the metadata llama.cpp reads, under the package's key names (gguf.Keys) with its file and token
type codes; every tensor's name (the Hugging Face name mapped by the package's own converter
table, gguf.get_tensor_name_map), shape, type and aligned offset; every value dequantized by
gguf.quants.dequantize within half a quantization step of the checkpoint's (f16: float16
rounding; f32: exact). Each block's float16 scale equals, bit for bit, the one the package's
quantizer (gguf.quants.quantize, a port of ggml's reference quantizers) gives the checkpoint's
values, and Q8_0 blocks equal its blocks whole. Q4_0 codes may differ from its codes by one where
a value lies exactly halfway between two (x / d + 8.5 an integer, which bfloat16 inputs make
common): the writer rounds x * (1 / d) + 8.5 once, as ggml's C reference compiles (a fused
multiply-add), the package's numpy port rounds twice; both codes are half a step away, which the
bound allows. A NaN or infinity on either side fails. Also that a GPTQ checkpoint is refused."""
import argparse
import importlib.metadata
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
from numeric import NumericMismatch, assert_close, difference  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WRITER = os.path.join(ROOT, "bench", "gguf_writer.py")
H, V, L = 64, 40, 2
QK = 32
Q = gguf.GGMLQuantizationType
F32, F16, Q4_0, Q8_0 = Q.F32, Q.F16, Q.Q4_0, Q.Q8_0
MODELS = {"tied": {"tied": True, "intermediate": 96}, "untied": {"tied": False, "intermediate": 80}}
FILE_TYPES = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
              "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}
ARCH = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2]


def write_safetensors(path, shapes, rng, bf16):
    """Standard normal tensors of `shapes` (name -> shape) as one safetensors file, bfloat16 (by
    truncation) or float32; returns each tensor's values as float32."""
    values, header, blobs, offset = {}, {}, [], 0
    for name, shape in shapes.items():
        x = rng.standard_normal(shape).astype(np.float32)
        if bf16:
            bits = (x.view(np.uint32) >> 16).astype("<u2")
            values[name] = (bits.astype(np.uint32) << 16).view(np.float32)
            blob = bits.tobytes()
        else:
            values[name] = x
            blob = x.tobytes()
        header[name] = {"dtype": "BF16" if bf16 else "F32", "shape": list(shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    return values


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
    values = write_safetensors(os.path.join(d, "model.safetensors"), shapes, rng, bf16=True)
    vocab = {chr(ord("a") + i): i for i in range(26)}
    vocab.update({"ab": 26, "abc": 27})
    tokenizer = {"model": {"type": "BPE", "vocab": vocab, "merges": ["a b", "ab c"]},
                 "added_tokens": [{"id": 30, "content": "<|endoftext|>", "special": True}]}
    json.dump(tokenizer, open(os.path.join(d, "tokenizer.json"), "w"))
    return values


def expected_type(kind, tied, name, shape):
    if len(shape) == 1:
        return F32
    if kind == "f16" or shape[-1] % QK:  # a row that is not whole blocks stays float16
        return F16
    if kind == "q8_0" or name == "output.weight" or (tied and name == "token_embd.weight"):
        return Q8_0
    return Q4_0


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


def field(reader, key):
    f = reader.get_field(key)
    return None if f is None else f.contents()


def check_metadata(reader, kind, inter):
    k = gguf.Keys
    expect = {k.General.ARCHITECTURE: ARCH, k.General.FILE_TYPE: FILE_TYPES[kind],
              k.General.QUANTIZATION_VERSION: gguf.GGML_QUANT_VERSION,
              k.General.ALIGNMENT: gguf.GGUF_DEFAULT_ALIGNMENT,
              k.LLM.CONTEXT_LENGTH.format(arch=ARCH): 128, k.LLM.EMBEDDING_LENGTH.format(arch=ARCH): H,
              k.LLM.BLOCK_COUNT.format(arch=ARCH): L, k.LLM.FEED_FORWARD_LENGTH.format(arch=ARCH): inter,
              k.Attention.HEAD_COUNT.format(arch=ARCH): 4, k.Attention.HEAD_COUNT_KV.format(arch=ARCH): 2,
              k.Rope.FREQ_BASE.format(arch=ARCH): 1e6,
              k.Attention.LAYERNORM_RMS_EPS.format(arch=ARCH): float(np.float32(1e-6)),
              k.Tokenizer.MODEL: "gpt2", k.Tokenizer.PRE: "qwen2", k.Tokenizer.MERGES: ["a b", "ab c"],
              k.Tokenizer.BOS_ID: 30, k.Tokenizer.EOS_ID: 30, k.Tokenizer.ADD_BOS: False}
    failures = [f"{key} = {field(reader, key)!r}, expected {want!r}" for key, want in expect.items()
                if field(reader, key) != want]
    tokens, types = field(reader, k.Tokenizer.LIST), field(reader, k.Tokenizer.TOKEN_TYPE)
    t = gguf.TokenType
    if (len(tokens or []) != V or len(types or []) != V or tokens[27] != "abc" or tokens[35] != "[PAD35]"
            or (types[0], types[27], types[30], types[35]) != (t.NORMAL, t.NORMAL, t.CONTROL, t.UNUSED)):
        failures.append(f"tokens {(tokens or [])[25:36]} of {len(tokens or [])}, types {(types or [])[25:36]}")
    return failures


def check_values(name, t, x, tensor):
    """The tensor's values dequantized by the package against the checkpoint's x; its block scales
    (and Q8_0 blocks whole) against the package's quantizer. Returns what is wrong."""
    failures = []
    got = gguf.quants.dequantize(tensor.data, t).reshape(x.shape)
    if t == F32:
        bound = np.zeros(x.shape)
    elif t == F16:
        bound = (2.0 ** -11) * np.abs(x) + 1e-7
    else:
        block_bytes = gguf.GGML_QUANT_SIZES[t][1]
        ours = np.asarray(tensor.data).reshape(-1, block_bytes)
        theirs = gguf.quants.quantize(x, t).reshape(-1, block_bytes)
        # A block opens with its float16 scale d (ggml's block_q8_0 / block_q4_0).
        d = theirs[:, :2].copy().view("<f2")
        try:
            assert_close(ours[:, :2].copy().view("<f2"), d,
                         what=f"{name}: float16 block scales (index: block) against gguf.quants.quantize's")
        except NumericMismatch as e:
            failures.append(str(e))
        if t == Q8_0 and not np.array_equal(ours, theirs):
            failures.append(f"{name}: {int(np.sum(np.any(ours != theirs, axis=1)))} of {len(ours)} Q8_0 blocks "
                            f"differ from gguf.quants.quantize's")
        # Half a step of the block's float16 scale, plus that scale's own float16 rounding times the
        # largest code (128); Q4_0's codes reach -8 d .. 7 d with d = m / -8, so a value near -m
        # takes a whole step.
        step = np.abs(d.astype(np.float32)).repeat(QK, axis=1).reshape(x.shape)
        clamped = (t == Q4_0) & (np.abs(x) > 7.5 * step)
        bound = step * (np.where(clamped, 1.0, 0.5) + 128 * 2.0 ** -11)
    problem = within_bound(got, x, bound)
    if problem:
        failures.append(f"{name} ({t.name}) dequantized by gguf.quants.dequantize: {problem}")
    return failures


def check_file(model, kind, reader, values, inter, tied):
    failures = check_metadata(reader, kind, inter)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, L)
    gguf_name = {hf: names.get_name(hf, try_suffixes=(".weight", ".bias")) for hf in values}
    tensors = {t.name: t for t in reader.tensors}
    want_names = set(gguf_name.values())
    if set(tensors) != want_names:
        failures.append(f"tensors {sorted(set(tensors) ^ want_names)} differ from the checkpoint's "
                        f"({'tied: no output.weight' if tied else 'untied: output.weight from lm_head.weight'})")
    seen = set()
    for hf, x in values.items():
        name = gguf_name[hf]
        if name not in tensors:
            continue
        tensor = tensors[name]
        shape = tuple(reversed(tensor.shape.tolist()))  # GGUF lists dims fastest first
        offset = tensor.data_offset - reader.data_offset
        if shape != x.shape or offset % reader.alignment:
            failures.append(f"{name} shape {shape} offset {offset}, expected {x.shape}, aligned")
            continue
        t = tensor.tensor_type
        want_t = expected_type(kind, tied, name, x.shape)
        if t != want_t:
            failures.append(f"{name} has type {t.name}, expected {want_t.name}")
            continue
        seen.add(t)
        failures += check_values(name, t, x, tensor)
    # The q4_0 file holds every type the model can give: Q4_0, the Q8_0 head, float32 1-D tensors,
    # and float16 where a row is not whole blocks.
    if kind == "q4_0" and seen != {F32, Q4_0, Q8_0} | ({F16} if inter % QK else set()):
        failures.append(f"tensor types {sorted(t.name for t in seen)}")
    return [f"{model} {kind}: {f}" for f in failures]


def check_moe(work):
    """A Qwen3-MoE checkpoint (4 experts, 2 a token): llama.cpp's qwen3moe names and metadata, the
    router in float32, and each layer's experts stacked in id order into [experts, rows, cols]
    tensors whose slices are the experts' float16 values."""
    d = os.path.join(work, "model-moe")
    os.makedirs(d, exist_ok=True)
    E, I = 4, 32
    config = {"model_type": "qwen3_moe", "hidden_size": H, "intermediate_size": 96, "num_hidden_layers": L,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": V,
              "rope_theta": 1e6, "rms_norm_eps": 1e-6, "max_position_embeddings": 128, "tie_word_embeddings": False,
              "eos_token_id": 30, "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": I,
              "norm_topk_prob": True}
    rng = np.random.default_rng(9)
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for l in range(L):
        p = f"model.layers.{l}."
        shapes.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "self_attn.q_proj.weight": (64, H), p + "self_attn.k_proj.weight": (32, H),
                       p + "self_attn.v_proj.weight": (32, H), p + "self_attn.o_proj.weight": (H, 64),
                       p + "self_attn.q_norm.weight": (16,), p + "self_attn.k_norm.weight": (16,),
                       p + "mlp.gate.weight": (E, H)})
        for e in reversed(range(E)):  # the file's order is not the experts' order
            shapes.update({p + f"mlp.experts.{e}.gate_proj.weight": (I, H), p + f"mlp.experts.{e}.up_proj.weight": (I, H),
                           p + f"mlp.experts.{e}.down_proj.weight": (H, I)})
    values = write_safetensors(os.path.join(d, "model.safetensors"), shapes, rng, bf16=False)
    json.dump(config, open(os.path.join(d, "config.json"), "w"))
    shutil.copy(os.path.join(work, "model-tied", "tokenizer.json"), d)
    out = os.path.join(work, "model-moe-f16.gguf")
    subprocess.run([sys.executable, WRITER, "--model", d, "--type", "f16", "--out", out], check=True)
    reader = gguf.GGUFReader(out)
    failures = []
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN3MOE]
    for key, want in ((f"{arch}.expert_count", E), (f"{arch}.expert_used_count", 2),
                      (f"{arch}.expert_feed_forward_length", I), (f"{arch}.attention.key_length", 16),
                      ("general.architecture", arch)):
        if field(reader, key) != want:
            failures.append(f"moe: {key} is {field(reader, key)!r}, expected {want!r}")
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, L)
    for hf, x in values.items():
        if ".mlp.experts." in hf:
            continue
        name = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        t = tensors.get(name)
        want_t = F32 if x.ndim == 1 or name.endswith("ffn_gate_inp.weight") else F16
        if t is None or t.tensor_type != want_t:
            failures.append(f"moe: {hf} -> {name}: {None if t is None else t.tensor_type.name}, expected {want_t.name}")
            continue
        failures += check_values(name, want_t, x, t)
    for l in range(L):
        for proj, gguf_proj in (("gate_proj", "ffn_gate_exps"), ("up_proj", "ffn_up_exps"), ("down_proj", "ffn_down_exps")):
            stacked = np.stack([values[f"model.layers.{l}.mlp.experts.{e}.{proj}.weight"] for e in range(E)])
            name = f"blk.{l}.{gguf_proj}.weight"
            t = tensors.get(name)
            if t is None or tuple(reversed(t.shape.tolist())) != stacked.shape:
                failures.append(f"moe: {name}: {None if t is None else tuple(reversed(t.shape.tolist()))}, "
                                f"expected {stacked.shape}")
                continue
            failures += check_values(name, t.tensor_type, stacked, t)
    return failures


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    work = parser.parse_args().workdir
    print(f"gguf {importlib.metadata.version('gguf')}")
    failures = []
    for seed, (model_name, spec) in enumerate(MODELS.items(), start=3):
        model = os.path.join(work, f"model-{model_name}")
        values = write_checkpoint(model, spec["tied"], spec["intermediate"], seed)
        for kind in ("f16", "q8_0", "q4_0"):
            out = os.path.join(work, f"model-{model_name}-{kind}.gguf")
            subprocess.run([sys.executable, WRITER, "--model", model, "--type", kind, "--out", out], check=True)
            failures += check_file(model_name, kind, gguf.GGUFReader(out), values, spec["intermediate"],
                                   spec["tied"])
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
    failures += check_moe(work)
    for f in failures:
        print("FAIL", f)
    print("gguf_writer:", "ok" if not failures else f"{len(failures)} failures")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
