#!/usr/bin/python3
"""Writes a Hugging Face Qwen2 or Qwen3-MoE checkpoint as a GGUF v3 file for llama.cpp (the speed
comparison with llama.cpp, bench/llama_cpp_generate.mjs, runs on the same weights as memtune).

Input: a model directory (config.json with model_type "qwen2" or "qwen3_moe", model.safetensors or shards named
by model.safetensors.index.json, float32 / bfloat16 / float16, tied or untied embeddings, q/k/v
biases) and a tokenizer.json (byte-level BPE; tokenizer_config.json beside it, when present,
names bos / eos / pad and the chat template). GPTQ / AWQ checkpoints are refused: convert the
float checkpoint they were quantized from.

Output tensor types, by --type (1-D tensors, the norms and the biases, stay float32 in every case):
  f32   every weight in float32 (a reference for checks: llama.cpp then multiplies in float32).
  f16   every 2-D weight in float16 (the Hugging Face converter's --outtype f16).
  q8_0  every 2-D weight in Q8_0, the token embedding and the output head included (what
        llama-quantize's Q8_0 gives: its output-tensor rule keeps Q8_0).
  q4_0  every 2-D weight in Q4_0 but the output head, which is Q8_0; with tied embeddings the head
        is token_embd.weight, so that one is Q8_0, while an untied token_embd stays Q4_0. This is
        llama-quantize's Q4_0 mixture when the hidden size is not a multiple of 256 (Qwen2.5-0.5B:
        896); for multiples of 256 llama-quantize gives the head Q6_K, which this script does not
        write, so there the head here is a little larger (8.5 against 6.56 bits per weight).
Q8_0 and Q4_0 follow ggml's reference quantizers: blocks of 32 along a row, one float16 scale per
block; Q8_0 scale = max|x| / 127 and codes round(x / scale); Q4_0 scale = m / -8 for the m of largest
magnitude, codes min(15, trunc(x / scale + 8.5)), the block's first 16 codes in the low nibbles and
the last 16 in the high ones. A row length that is not a multiple of 32 keeps float16.

Layout facts llama.cpp relies on: tensor dims are written fastest-first (a [rows, cols] weight
becomes ne = [cols, rows]), data offsets are multiples of general.alignment (32), and Qwen2's q/k
weights are written as stored (llama.cpp applies Qwen2's rope as NEOX, on the checkpoint's layout;
only the Llama converter permutes q/k). A qwen3_moe model (llama.cpp's "qwen3moe") adds q/k norms,
the router (ffn_gate_inp) and each layer's experts stacked into three 3-D tensors, ffn_gate_exps /
ffn_up_exps [experts, moe_intermediate, hidden] and ffn_down_exps [experts, hidden,
moe_intermediate], expert by expert in id order, as the Hugging Face converter stacks them. The token list is padded to config.json's vocab_size with
"[PAD<id>]" tokens of type UNUSED, as the Hugging Face converter does.

Usage: gguf_writer.py --model DIR [--tokenizer DIR_OR_FILE] --type f32|f16|q8_0|q4_0 --out FILE.gguf
"""

import argparse
import json
import os
import re
import struct
import sys

import numpy as np

GGUF_VERSION = 3
ALIGNMENT = 32
QK = 32  # values per Q8_0 / Q4_0 block

# ggml tensor types and the bytes of one block of QK values.
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q8_0 = 0, 1, 2, 8
BLOCK_BYTES = {GGML_Q4_0: 2 + QK // 2, GGML_Q8_0: 2 + QK}
# general.file_type (llama_ftype) per --type.
FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}

# GGUF metadata value types.
T_UINT32, T_INT32, T_FLOAT32, T_BOOL, T_STRING, T_ARRAY = 4, 5, 6, 7, 8, 9

# Token types of tokenizer.ggml.token_type.
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5


class InputError(Exception):
    pass


# ---------------------------------------------------------------------------------------------
# checkpoint
# ---------------------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


class Checkpoint:
    """The tensors of model.safetensors (or its shards), read lazily as float32 row ranges."""

    def __init__(self, model_dir):
        single = os.path.join(model_dir, "model.safetensors")
        index = os.path.join(model_dir, "model.safetensors.index.json")
        if os.path.exists(single):
            files = [single]
        elif os.path.exists(index):
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise InputError(f"{index}: no weight_map")
            files = [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
        else:
            raise InputError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")
        self.tensors = {}  # name -> (path, dtype name, shape, absolute byte offset)
        for path in files:
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(header_len))
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name.endswith((".qweight", ".qzeros", ".scales", ".g_idx")):
                    raise InputError(f"{path}: tensor {name} is a GPTQ / AWQ packed weight; "
                                     "gguf_writer needs the float checkpoint it was quantized from")
                if info["dtype"] not in SAFETENSORS_DTYPES:
                    raise InputError(f"{path}: tensor {name} has dtype {info['dtype']}; "
                                     "supported: F32, BF16, F16")
                begin, end = info["data_offsets"]
                nbytes = int(np.prod(info["shape"], dtype=np.int64)) * (4 if info["dtype"] == "F32" else 2)
                if end - begin != nbytes:
                    raise InputError(f"{path}: tensor {name} spans {end - begin} bytes, "
                                     f"expected {nbytes} for {info['dtype']}{info['shape']}")
                self.tensors[name] = (path, info["dtype"], tuple(info["shape"]), 8 + header_len + begin)
        self.maps = {}

    def shape(self, name):
        return self.tensors[name][2]

    def rows(self, name, start, stop):
        """Rows [start, stop) of a tensor (a 1-D tensor is one row) as float32."""
        path, dtype, shape, offset = self.tensors[name]
        if path not in self.maps:
            self.maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        cols = shape[-1] if len(shape) > 1 else shape[0]
        width = 4 if dtype == "F32" else 2
        raw = self.maps[path][offset + start * cols * width: offset + stop * cols * width]
        values = raw.view(SAFETENSORS_DTYPES[dtype]).reshape(stop - start, cols)
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            return (values.astype(np.uint32) << 16).view(np.float32)
        return values.astype(np.float32)


def hf_to_gguf_name(name):
    """The llama.cpp name of a Qwen2ForCausalLM / Qwen3MoeForCausalLM tensor, or None for one this
    script does not know. A routed expert's projection maps to its layer's stacked tensor."""
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", name)
    if not m:
        return None
    parts = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate": "ffn_gate_inp"}
    expert = re.fullmatch(r"mlp\.experts\.\d+\.(gate|up|down)_proj", m.group(2))
    if expert:
        return f"blk.{m.group(1)}.ffn_{expert.group(1)}_exps.{m.group(3)}"
    part = parts.get(m.group(2))
    return f"blk.{m.group(1)}.{part}.{m.group(3)}" if part else None


# ---------------------------------------------------------------------------------------------
# quantization (float32 arithmetic, as ggml's reference quantizers)
# ---------------------------------------------------------------------------------------------

def quantize_q8_0(x):
    """x: float32 [n, 32] -> uint8 [n, 34]: float16 scale, then 32 int8 codes."""
    d = np.abs(x).max(axis=1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    v = (x * inv[:, None]).astype(np.float64)  # exact; rounding half away from zero, as roundf
    codes = np.trunc(v + np.copysign(0.5, v)).astype(np.int8)
    out = np.empty((len(x), BLOCK_BYTES[GGML_Q8_0]), np.uint8)
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:] = codes.view(np.uint8)
    return out


def quantize_q4_0(x):
    """x: float32 [n, 32] -> uint8 [n, 18]: float16 scale, then 16 bytes of 4-bit codes."""
    # The value of largest magnitude, the first one on ties (argmax returns the first).
    m = x[np.arange(len(x)), np.argmax(np.abs(x), axis=1)]
    d = m / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    # x / scale + 8.5 with one rounding, as ggml's reference compiles (a fused multiply-add; the
    # float64 product of two float32 values is exact).
    codes = np.minimum(np.trunc(x.astype(np.float64) * inv[:, None] + 8.5), 15).astype(np.uint8)
    out = np.empty((len(x), BLOCK_BYTES[GGML_Q4_0]), np.uint8)
    out[:, :2] = d.astype("<f2").view(np.uint8).reshape(-1, 2)
    out[:, 2:] = codes[:, :QK // 2] | (codes[:, QK // 2:] << 4)
    return out


def tensor_bytes(ggml_type, shape):
    n = int(np.prod(shape, dtype=np.int64))
    if ggml_type in BLOCK_BYTES:
        return n // QK * BLOCK_BYTES[ggml_type]
    return n * (4 if ggml_type == GGML_F32 else 2)


def encode_rows(ggml_type, x):
    """float32 rows -> the bytes of those rows in ggml_type."""
    if ggml_type == GGML_F32:
        return x.astype("<f4").tobytes()
    if ggml_type == GGML_F16:
        return x.astype("<f2").tobytes()
    blocks = x.reshape(-1, QK)
    return (quantize_q8_0 if ggml_type == GGML_Q8_0 else quantize_q4_0)(blocks).tobytes()


# ---------------------------------------------------------------------------------------------
# GGUF encoding
# ---------------------------------------------------------------------------------------------

def gguf_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def gguf_value(vtype, value):
    if vtype == T_STRING:
        return gguf_string(value)
    return struct.pack({T_UINT32: "<I", T_INT32: "<i", T_FLOAT32: "<f", T_BOOL: "<?"}[vtype], value)


def gguf_kv(key, vtype, value, elem_type=None):
    """One metadata pair; an array takes elem_type and a list of values."""
    out = gguf_string(key) + struct.pack("<I", vtype)
    if vtype != T_ARRAY:
        return out + gguf_value(vtype, value)
    out += struct.pack("<IQ", elem_type, len(value))
    if elem_type == T_INT32:
        return out + np.asarray(value, dtype="<i4").tobytes()
    return out + b"".join(gguf_value(elem_type, v) for v in value)


# ---------------------------------------------------------------------------------------------
# config and tokenizer metadata
# ---------------------------------------------------------------------------------------------

def load_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise InputError(f"{path}: not found ({what})")
    except json.JSONDecodeError as e:
        raise InputError(f"{path}: not valid JSON: {e}")


def model_metadata(config_path, config):
    if "quantization_config" in config:
        method = config["quantization_config"].get("quant_method", "?")
        raise InputError(f"{config_path}: quantization_config names a {method} checkpoint; gguf_writer "
                         "needs the float checkpoint it was quantized from")
    a = architecture(config_path, config)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(config.get(key), int):
            raise InputError(f"{config_path}: field {key} is missing or not an integer")
    heads = config["num_attention_heads"]
    kv = [
        (f"{a}.context_length", T_UINT32, config.get("max_position_embeddings", 32768)),
        (f"{a}.embedding_length", T_UINT32, config["hidden_size"]),
        (f"{a}.block_count", T_UINT32, config["num_hidden_layers"]),
        (f"{a}.feed_forward_length", T_UINT32, config["intermediate_size"]),
        (f"{a}.attention.head_count", T_UINT32, heads),
        (f"{a}.attention.head_count_kv", T_UINT32, config.get("num_key_value_heads", heads)),
        (f"{a}.rope.freq_base", T_FLOAT32, float(config.get("rope_theta", 10000.0))),
        (f"{a}.attention.layer_norm_rms_epsilon", T_FLOAT32, float(config.get("rms_norm_eps", 1e-6))),
    ]
    if a == "qwen3moe":
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1:
            raise InputError(f"{config_path}: dense layers among the sparse ones (mlp_only_layers, "
                             "decoder_sparse_step) are not written")
        kv += [(f"{a}.attention.key_length", T_UINT32, head_dim),
               (f"{a}.attention.value_length", T_UINT32, head_dim),
               (f"{a}.expert_count", T_UINT32, config["num_experts"]),
               (f"{a}.expert_used_count", T_UINT32, config["num_experts_per_tok"]),
               (f"{a}.expert_feed_forward_length", T_UINT32, config["moe_intermediate_size"])]
    scaling = config.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "yarn":
        kv += [("qwen2.rope.scaling.type", T_STRING, "yarn"),
               ("qwen2.rope.scaling.factor", T_FLOAT32, float(scaling["factor"])),
               ("qwen2.rope.scaling.original_context_length", T_UINT32,
                scaling["original_max_position_embeddings"])]
    elif kind not in (None, "default"):
        raise InputError(f"{config_path}: rope_scaling type {kind!r} is not supported (none or yarn)")
    return [(key.replace("qwen2.", f"{a}.", 1), *rest) for key, *rest in kv]


def architecture(config_path, config):
    """llama.cpp's architecture name for config.json's model_type."""
    names = {"qwen2": "qwen2", "qwen3_moe": "qwen3moe"}
    if config.get("model_type") not in names:
        raise InputError(f"{config_path}: model_type is {config.get('model_type')!r}; supported: "
                         + ", ".join(f'"{n}"' for n in names))
    if config.get("model_type") == "qwen3_moe" and not config.get("norm_topk_prob", False):
        raise InputError(f"{config_path}: norm_topk_prob is false; llama.cpp's qwen3moe renormalizes the experts' weights")
    return names[config["model_type"]]


def tokenizer_metadata(tokenizer_arg, config, config_path):
    path = os.path.join(tokenizer_arg, "tokenizer.json") if os.path.isdir(tokenizer_arg) else tokenizer_arg
    tok = load_json(path, "the tokenizer: pass --tokenizer DIR_OR_FILE")
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise InputError(f"{path}: model.type is {model.get('type')!r}; a byte-level BPE tokenizer is needed")
    ids = dict(model["vocab"])
    added = {}
    for t in tok.get("added_tokens", []):
        ids[t["content"]] = t["id"]
        added[t["id"]] = t
    vocab_size = config["vocab_size"]
    if max(ids.values()) >= vocab_size:
        raise InputError(f"{path}: token id {max(ids.values())} does not fit {config_path}'s vocab_size {vocab_size}")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [TOKEN_UNUSED] * vocab_size
    for text, i in ids.items():
        tokens[i] = text
        if i in added:  # special ones, and those shaped like <|...|>, are control tokens
            special = added[i].get("special") or re.fullmatch(r"<\|.*\|>", text) is not None
            types[i] = TOKEN_CONTROL if special else TOKEN_USER_DEFINED
        else:
            types[i] = TOKEN_NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]

    # bos / eos / pad: tokenizer_config.json beside tokenizer.json, then config.json's ids.
    config_tok_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
    tok_config = load_json(config_tok_path, "") if os.path.exists(config_tok_path) else {}
    kv = [("tokenizer.ggml.model", T_STRING, "gpt2"), ("tokenizer.ggml.pre", T_STRING, "qwen2"),
          ("tokenizer.ggml.tokens", T_ARRAY, tokens, T_STRING),
          ("tokenizer.ggml.token_type", T_ARRAY, types, T_INT32),
          ("tokenizer.ggml.merges", T_ARRAY, merges, T_STRING)]
    special_ids = {}
    for kind, key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("pad", "padding_token_id")):
        entry = tok_config.get(f"{kind}_token")
        text = entry.get("content") if isinstance(entry, dict) else entry
        token_id = ids.get(text) if text else config.get(f"{kind}_token_id")
        if isinstance(token_id, list):
            token_id = token_id[0] if token_id else None
        if token_id is None and kind == "bos":
            # Qwen2.5 has no bos in its tokenizer_config.json; its config.json names <|endoftext|>.
            token_id = ids.get("<|endoftext|>")
        if token_id is not None:
            special_ids[kind] = token_id
            kv.append((f"tokenizer.ggml.{key}", T_UINT32, token_id))
    kv.append(("tokenizer.ggml.add_bos_token", T_BOOL, bool(tok_config.get("add_bos_token", False))))
    if isinstance(tok_config.get("chat_template"), str):
        kv.append(("tokenizer.chat_template", T_STRING, tok_config["chat_template"]))
    return kv, len(ids), special_ids


# ---------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------

def expert_id(hf_name):
    m = re.search(r"\.mlp\.experts\.(\d+)\.", hf_name)
    return int(m.group(1)) if m else -1


def plan_tensors(ckpt, config, config_path, out_type):
    """[(gguf name, [hf names], shape, ggml type)] in checkpoint order, the output head checked; a
    stacked expert tensor lists its experts' tensors in id order and has shape [experts, rows, cols]."""
    tied = config.get("tie_word_embeddings", False)
    plan, stacked = [], {}
    for hf_name in ckpt.tensors:
        name = hf_to_gguf_name(hf_name)
        if name is None:
            raise InputError(f"{ckpt.tensors[hf_name][0]}: tensor {hf_name} is not part of a "
                             "Qwen2ForCausalLM or Qwen3MoeForCausalLM")
        if name == "output.weight" and tied:
            continue  # tied: llama.cpp reads the head from token_embd
        if "_exps." in name:
            if name not in stacked:
                stacked[name] = []
                plan.append([name, stacked[name], None, None])
            stacked[name].append(hf_name)
            continue
        plan.append([name, [hf_name], ckpt.shape(hf_name), None])
    for entry in plan:
        name, hf_names = entry[0], entry[1]
        if name in stacked:
            hf_names.sort(key=expert_id)
            if [expert_id(n) for n in hf_names] != list(range(config.get("num_experts", -1))):
                raise InputError(f"{config_path}: {name} does not stack experts 0..{config.get('num_experts')} - 1")
            entry[2] = (len(hf_names), *ckpt.shape(hf_names[0]))
    typed = []
    for name, hf_names, shape, _ in plan:
        if len(shape) == 1 or out_type == "f32":
            ggml_type = GGML_F32
        elif out_type == "f16" or shape[-1] % QK != 0:
            ggml_type = GGML_F16
        elif out_type == "q8_0" or name == "output.weight" or (tied and name == "token_embd.weight"):
            ggml_type = GGML_Q8_0
        else:
            ggml_type = GGML_Q4_0
        if name.endswith("ffn_gate_inp.weight"):
            ggml_type = GGML_F32  # the router stays float32, as llama.cpp's quantizer leaves it
        typed.append((name, hf_names, shape, ggml_type))
    plan = typed
    names = {p[0] for p in plan}
    if "token_embd.weight" not in names:
        raise InputError(f"{config_path}: the checkpoint has no model.embed_tokens.weight")
    if not tied and "output.weight" not in names:
        raise InputError(f"{config_path}: tie_word_embeddings is false but the checkpoint has no lm_head.weight")
    return plan


def main():
    parser = argparse.ArgumentParser(description="Write a Qwen2 or Qwen3-MoE checkpoint as a GGUF v3 file.")
    parser.add_argument("--model", required=True, help="Hugging Face model directory")
    parser.add_argument("--tokenizer", help="tokenizer directory or tokenizer.json (default: --model)")
    parser.add_argument("--type", required=True, choices=sorted(FILE_TYPES), help="weight type")
    parser.add_argument("--out", required=True, help="the .gguf file to write")
    args = parser.parse_args()

    config_path = os.path.join(args.model, "config.json")
    config = load_json(config_path, "the model's config")
    kv = [("general.architecture", T_STRING, architecture(config_path, config)),
          ("general.name", T_STRING, os.path.basename(os.path.normpath(args.model))),
          ("general.file_type", T_UINT32, FILE_TYPES[args.type]),
          ("general.quantization_version", T_UINT32, 2),
          ("general.alignment", T_UINT32, ALIGNMENT)]
    kv += model_metadata(config_path, config)
    tokenizer_kv, n_tokens, special = tokenizer_metadata(args.tokenizer or args.model, config, config_path)
    kv += tokenizer_kv
    ckpt = Checkpoint(args.model)
    plan = plan_tensors(ckpt, config, config_path, args.type)

    header = struct.pack("<4sIQQ", b"GGUF", GGUF_VERSION, len(plan), len(kv))
    header += b"".join(gguf_kv(*entry) for entry in kv)
    offset = 0
    for name, _, shape, ggml_type in plan:
        dims = list(reversed(shape))  # fastest-varying first
        header += gguf_string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)
        offset += tensor_bytes(ggml_type, shape)
        offset += -offset % ALIGNMENT
    header += b"\0" * (-len(header) % ALIGNMENT)

    tmp = args.out + ".tmp"
    with open(tmp, "wb") as f:
        f.write(header)
        for name, hf_names, shape, ggml_type in plan:
            for hf_name in hf_names:  # a stacked tensor: each expert's rows after the previous one's
                rows = shape[-2] if len(shape) > 1 else 1
                cols = shape[-1]
                step = max(1, (1 << 22) // cols)  # about 16 MB of float32 at a time
                for start in range(0, rows, step):
                    f.write(encode_rows(ggml_type, ckpt.rows(hf_name, start, min(rows, start + step))))
            f.write(b"\0" * (-tensor_bytes(ggml_type, shape) % ALIGNMENT))
    os.replace(tmp, args.out)
    counts = {}
    for _, _, _, t in plan:
        label = {GGML_F32: "f32", GGML_F16: "f16", GGML_Q8_0: "q8_0", GGML_Q4_0: "q4_0"}[t]
        counts[label] = counts.get(label, 0) + 1
    print(f"wrote {args.out}: {len(plan)} tensors ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))}), "
          f"{n_tokens} tokens padded to {config['vocab_size']}, special ids {special}, "
          f"{os.path.getsize(args.out) / 1e6:.1f} MB", file=sys.stderr)


if __name__ == "__main__":
    try:
        main()
    except InputError as e:
        print(f"gguf_writer: error: {e}", file=sys.stderr)
        sys.exit(1)
