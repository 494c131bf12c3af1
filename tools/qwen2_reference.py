#!/usr/bin/python3
"""Reference Qwen2ForCausalLM in plain PyTorch: the independent numerical oracle for memtune.

memtune reimplements Qwen2 training in C++ with hand-written kernels and backward passes. This
file recomputes the same quantities (logits, the causal-LM loss, and every parameter gradient)
with PyTorch autograd, written from the Hugging Face Qwen2 modeling semantics rather than from
memtune's code, so the two can be compared tensor by tensor
(tests/reference/compare_with_reference.py). With --adapter it applies a PEFT LoRA adapter
(written from PEFT's documented LoraLayer semantics) to the frozen base model and differentiates
the adapter tensors only. It also provides the eager-PyTorch baseline for memtune's
throughput/memory benchmark.

Run it with Debian's /usr/bin/python3 (torch + numpy); it has no other dependencies.

    qwen2_reference.py dump  --model DIR --input IN.json --out OUT.safetensors [--adapter ADIR]
                             [--dropout_seed N]
    qwen2_reference.py bench --model DIR --batch B --seq T --steps N [--threads K]
    qwen2_reference.py train-bench --model DIR --batch B --seq T --steps N [--threads K]
                                   [--tuner full|lora] [--lora_rank R] [--lora_alpha A]
                                   [--target_modules all-linear|NAME...] [--lr LR] [--device cuda]
                                   [--autocast bf16]
    qwen2_reference.py eval-bench --model DIR --batch B --seq T --num_sequences S
                                  [--threads K] [--mode full|argmax]
"""

import argparse
import json
import math
import os
import resource
import struct
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

IGNORE_INDEX = -100

# ---------------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------------

SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
SAFETENSORS_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


def read_safetensors(path):
    """Returns {name: tensor} in the stored dtype (F32, BF16 or F16), in file order."""
    tensors = {}
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
        data_start = 8 + header_len
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            dtype = SAFETENSORS_DTYPES[info["dtype"]]
            shape = info["shape"]
            begin, end = info["data_offsets"]
            nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
            if end - begin != nbytes:
                raise ValueError(f"{path}: tensor {name} spans {end - begin} bytes, "
                                 f"expected {nbytes} for {info['dtype']}{shape}")
            if nbytes == 0:
                tensors[name] = torch.empty(shape, dtype=dtype)
                continue
            # Read straight into a private bytearray: frombuffer shares its memory, and reading
            # tensor by tensor avoids holding the whole file in memory next to the parameters.
            buf = bytearray(nbytes)
            f.seek(data_start + begin)
            if f.readinto(buf) != nbytes:
                raise ValueError(f"{path}: tensor {name} runs past the end of the file")
            tensors[name] = torch.frombuffer(buf, dtype=dtype).reshape(shape)
    return tensors


def write_safetensors(path, tensors, metadata=None):
    """Writes {name: tensor} (F32, BF16 or F16) with contiguous offsets, in the given order."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    blobs = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_NAMES:
            raise ValueError(f"tensor {name}: cannot write dtype {t.dtype}")
        # reshape(-1) makes 0-d tensors viewable as bytes; numpy has no bfloat16, bytes it has.
        blob = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": SAFETENSORS_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    header_bytes += b" " * (-len(header_bytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header_bytes)))
        f.write(header_bytes)
        for blob in blobs:
            f.write(blob)


def read_checkpoint(model_dir):
    """Reads model.safetensors, or the shards listed in model.safetensors.index.json."""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return read_safetensors(single)
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        for name, t in read_safetensors(os.path.join(model_dir, shard)).items():
            if weight_map.get(name) != shard:
                raise ValueError(f"{shard}: tensor {name} is not mapped to this shard in {index_path}")
            tensors[name] = t
    missing = set(weight_map) - set(tensors)
    if missing:
        raise ValueError(f"{index_path}: tensors missing from their shards: {sorted(missing)}")
    return tensors


# ---------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------

@dataclass
class Qwen2Config:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    # Other families of the same block (transformers' Qwen3ForCausalLM, LlamaForCausalLM):
    model_type: str = "qwen2"
    attention_bias: bool = True   # q/k/v biases: always in Qwen2, `attention_bias` in Qwen3 and Llama
    qk_norm: bool = False         # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_llama3: dict = None      # Llama 3's rope_scaling (rope_type "llama3"), or None

    @staticmethod
    def from_json(doc):
        """Accepts the classic config.json form and the transformers-5 form (`rope_parameters`).
        Defaults are those of transformers' Qwen2Config. `torch_dtype`/`dtype` are not needed:
        tensors carry their dtype in the safetensors header and are upcast on load."""
        model_type = doc.get("model_type", "qwen2")
        if model_type not in ("qwen2", "qwen3", "llama"):
            raise ValueError(f"config: model_type {model_type!r} is not supported")
        rope = doc.get("rope_parameters") or {}
        scaling = doc.get("rope_scaling") or {}
        llama3 = None
        for source in (rope, scaling):
            rope_type = source.get("rope_type", source.get("type"))
            if rope_type == "llama3" and model_type == "llama":
                llama3 = {k: source[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings")}
            elif rope_type not in (None, "default"):
                raise ValueError(f"config: rope type {rope_type!r} is not supported")
        if doc.get("use_sliding_window"):
            raise ValueError("config: sliding-window attention is not supported")
        if doc.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config: hidden_act {doc['hidden_act']!r} is not supported")
        heads = doc["num_attention_heads"]
        kv_heads = doc.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"config: {heads} attention heads are not a multiple of {kv_heads} KV heads")
        return Qwen2Config(
            hidden_size=doc["hidden_size"],
            intermediate_size=doc["intermediate_size"],
            num_hidden_layers=doc["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            # transformers' Qwen3Config defaults head_dim to 128, the others to hidden / heads.
            head_dim=doc.get("head_dim") or (128 if model_type == "qwen3" else doc["hidden_size"] // heads),
            vocab_size=doc["vocab_size"],
            rms_norm_eps=float(doc.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", doc.get("rope_theta", 10000.0))),
            tie_word_embeddings=bool(doc.get("tie_word_embeddings", False)),
            model_type=model_type,
            attention_bias=True if model_type == "qwen2" else bool(doc.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            rope_llama3=llama3,
        )


def parameter_shapes(cfg):
    """The HF parameter names and shapes of a Qwen2ForCausalLM checkpoint, in model order."""
    d, i, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    shapes = {"model.embed_tokens.weight": [cfg.vocab_size, d]}
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = [d]
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            shapes[p + f"self_attn.{name}.weight"] = [rows, d]
            if cfg.attention_bias:
                shapes[p + f"self_attn.{name}.bias"] = [rows]
        shapes[p + "self_attn.o_proj.weight"] = [d, q]
        if cfg.qk_norm:
            shapes[p + "self_attn.q_norm.weight"] = [hd]
            shapes[p + "self_attn.k_norm.weight"] = [hd]
        shapes.update({
            p + "post_attention_layernorm.weight": [d],
            p + "mlp.gate_proj.weight": [i, d],
            p + "mlp.up_proj.weight": [i, d],
            p + "mlp.down_proj.weight": [d, i],
        })
    shapes["model.norm.weight"] = [d]
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = [cfg.vocab_size, d]
    return shapes


def load_model(model_dir, dtype=torch.float32):
    """Returns (config, {name: leaf parameter}) with parameters upcast to `dtype`. The checkpoint
    must hold exactly the expected tensors (a tied model has no lm_head.weight)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = Qwen2Config.from_json(json.load(f))
    stored = read_checkpoint(model_dir)
    shapes = parameter_shapes(cfg)
    if set(stored) != set(shapes):
        raise ValueError(f"{model_dir}: checkpoint tensors differ from the config's; "
                         f"missing {sorted(set(shapes) - set(stored))}, "
                         f"unexpected {sorted(set(stored) - set(shapes))}")
    params = {}
    for name, shape in shapes.items():
        if list(stored[name].shape) != shape:
            raise ValueError(f"{model_dir}: {name} has shape {list(stored[name].shape)}, expected {shape}")
        params[name] = stored.pop(name).to(dtype).requires_grad_(True)
    return cfg, params


# ---------------------------------------------------------------------------------------------
# LoRA adapter (PEFT format)
# ---------------------------------------------------------------------------------------------

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # PeftModelForCausalLM -> LoraModel -> Qwen2ForCausalLM

# adapter_config.json keys that change the computation when set; each must hold its default
# (an absent key, null, false or an empty container count as the default).
LORA_KEYS_MUST_BE_DEFAULT = (
    "fan_in_fan_out", "use_dora", "lora_bias", "rank_pattern", "alpha_pattern",
    "layers_to_transform", "layers_pattern", "modules_to_save", "layer_replication",
    "trainable_token_indices", "target_parameters", "exclude_modules", "megatron_config",
)


@dataclass
class LoraAdapter:
    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple
    scaling: float
    weights: dict  # {PEFT tensor name: leaf tensor}, model order, A before B
    dropout: float = 0.0      # adapter_config.json's lora_dropout
    dropout_seed: int = None  # None: evaluation mode (dropout is the identity); else training
                              # mode with memtune's masks (lora_dropout_keep)

    def pair(self, module):
        """(A [r, in], B [out, r]) for the module `model.layers.{i}.self_attn.q_proj` etc.,
        or None where the adapter does not target it."""
        a = self.weights.get(PEFT_PREFIX + module + ".lora_A.weight")
        return None if a is None else (a, self.weights[PEFT_PREFIX + module + ".lora_B.weight"])


def lora_shapes(cfg, target_modules):
    """{PEFT tensor name: shape}, in model order: lora_A [r, in] and lora_B [out, r] for every
    targeted linear of every layer. `r` is left as the placeholder None."""
    shapes = {}
    for name, shape in parameter_shapes(cfg).items():
        if not name.endswith(".weight"):
            continue
        module = name[:-len(".weight")]
        if module.rsplit(".", 1)[-1] in target_modules:
            out_features, in_features = shape
            shapes[PEFT_PREFIX + module + ".lora_A.weight"] = [None, in_features]
            shapes[PEFT_PREFIX + module + ".lora_B.weight"] = [out_features, None]
    return shapes


def read_lora_config(path):
    """Validates a PEFT LoraConfig (adapter_config.json) against what this reference computes:
    plain LoRA on some of the seven Qwen2 linears, same r and alpha everywhere, no bias, no
    DoRA, no extra trainable modules. Returns (r, lora_alpha, use_rslora, target_modules,
    lora_dropout)."""
    with open(path) as f:
        doc = json.load(f)
    if not isinstance(doc, dict):
        raise ValueError(f"{path}: expected a JSON object")

    def fail(msg):
        raise ValueError(f"{path}: {msg}")

    if doc.get("peft_type") != "LORA":
        fail(f"peft_type must be \"LORA\", got {doc.get('peft_type')!r}")
    if doc.get("task_type") not in (None, "CAUSAL_LM"):
        fail(f"task_type must be \"CAUSAL_LM\", got {doc['task_type']!r}")
    r = doc.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        fail(f"r must be a positive integer, got {r!r}")
    alpha = doc.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        fail(f"lora_alpha must be a finite number, got {alpha!r}")
    dropout = doc.get("lora_dropout", 0.0)
    if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0 <= dropout < 1:
        fail(f"lora_dropout must be a number in [0, 1), got {dropout!r}")
    use_rslora = doc.get("use_rslora", False)
    if not isinstance(use_rslora, bool):
        fail(f"use_rslora must be true or false, got {use_rslora!r}")
    if doc.get("bias", "none") != "none":
        fail(f"bias must be \"none\", got {doc['bias']!r}")
    for key in LORA_KEYS_MUST_BE_DEFAULT:
        if doc.get(key):
            fail(f"{key} = {doc[key]!r} is not supported")
    init = doc.get("init_lora_weights", True)
    if not isinstance(init, bool):
        # e.g. "pissa", "olora", "loftq": these rewrite the base weights when applied.
        fail(f"init_lora_weights = {init!r} is not supported")
    targets = doc.get("target_modules")
    if not isinstance(targets, list) or not targets:
        # A string is a regex (or "all-linear") in PEFT; only explicit lists are accepted here.
        fail(f"target_modules must be a nonempty list of {list(LORA_TARGETS)}, got {targets!r}")
    if any(t not in LORA_TARGETS for t in targets) or len(set(targets)) != len(targets):
        fail(f"target_modules must be distinct names among {list(LORA_TARGETS)}, got {targets!r}")
    return r, float(alpha), use_rslora, tuple(t for t in LORA_TARGETS if t in targets), float(dropout)


def load_adapter(adapter_dir, cfg, dtype=torch.float32, dropout_seed=None):
    """Reads ADIR/adapter_config.json and ADIR/adapter_model.safetensors. The file must hold
    exactly lora_A/lora_B for every targeted linear of every layer, with PEFT's names and shapes.
    Tensors are upcast to `dtype` and become leaves that require grad. `dropout_seed`: apply the
    config's lora_dropout as in training, with the masks memtune draws from that seed."""
    r, alpha, use_rslora, targets, dropout = read_lora_config(
        os.path.join(adapter_dir, "adapter_config.json"))
    path = os.path.join(adapter_dir, "adapter_model.safetensors")
    stored = read_safetensors(path)
    shapes = lora_shapes(cfg, targets)
    if set(stored) != set(shapes):
        raise ValueError(f"{path}: adapter tensors differ from the config's (targets {list(targets)}); "
                         f"missing {sorted(set(shapes) - set(stored))}, "
                         f"unexpected {sorted(set(stored) - set(shapes))}")
    weights = {}
    for name, shape in shapes.items():
        shape = [r if dim is None else dim for dim in shape]
        if list(stored[name].shape) != shape:
            raise ValueError(f"{path}: {name} has shape {list(stored[name].shape)}, expected {shape} (r = {r})")
        weights[name] = stored.pop(name).to(dtype).requires_grad_(True)
    # PEFT LoraLayer.update_layer: alpha / sqrt(r) with rank-stabilized LoRA, alpha / r otherwise.
    scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
    return LoraAdapter(r, alpha, use_rslora, targets, scaling, weights, dropout, dropout_seed)


# LoRA dropout masks. PEFT draws them from torch's RNG; to compare against memtune with the SAME
# masks they are recomputed here from memtune's documented contract (`memtune dump --dropout_seed`,
# src/backend/backend.h): the input x [N, in] of the linear at site s of layer l (the batch's rows
# packed one after another, N = B * T) has its element i = n * in + c kept when the top 24 bits of
# splitmix64(key + i * GOLDEN) are >= p * 2^24 (p rounded to float32 first, as memtune holds it),
# key = seed ^ ((l * 7 + s + 1) * GOLDEN), all modulo 2^64, sites in the order of LORA_TARGETS.
# Kept elements are scaled by 1 / (1 - p) (inverted dropout, as torch.nn.Dropout in training).
_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z):
    """splitmix64's finalizer on a Python int (memtune's core/rng.h mix64)."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return z ^ (z >> 31)


def lora_dropout_key(seed, layer, site):
    return _mix64((seed ^ ((layer * len(LORA_TARGETS) + site + 1) * _GOLDEN)) & _U64)


def lora_dropout_keep(key, numel, p):
    """bool numpy [numel]: which elements of a flat tensor the mask of `key` keeps."""
    threshold = int(float(np.float32(p)) * 16777216.0)  # (uint64_t)((double)(float)p * 2^24)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps modulo 2^64, as in C++
        z = np.uint64(key) + np.arange(numel, dtype=np.uint64) * np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return (z >> np.uint64(40)) >= np.uint64(threshold)


def lora_dropout(x, lora, layer, site):
    """Inverted dropout of x [B, T, in] (flattened row-major over the batch, as memtune packs it)
    with the mask of (layer, site): x * keep / (1 - p), as torch.nn.Dropout in training."""
    keep = lora_dropout_keep(lora_dropout_key(lora.dropout_seed, layer, site), x.numel(), lora.dropout)
    return x * torch.from_numpy(keep).view(x.shape).to(x.dtype) / (1.0 - lora.dropout)


# ---------------------------------------------------------------------------------------------
# model
# ---------------------------------------------------------------------------------------------

def linear(h, params, module, lora, bias=False):
    """The linear `module` (e.g. model.layers.0.mlp.up_proj), plus its LoRA update where the
    adapter targets it. PEFT LoraLayer.forward: base(x) + lora_B(lora_A(dropout(x))) * scaling,
    i.e. y = x W^T + b + ((dropout(x) A^T) B^T) * scaling: only the LoRA branch sees the dropped
    input; dropout is the identity in evaluation mode (the adapter has no dropout_seed)."""
    y = F.linear(h, params[module + ".weight"], params[module + ".bias"] if bias else None)
    pair = lora.pair(module) if lora is not None else None
    if pair is not None:
        a, b = pair
        x = h
        if lora.dropout_seed is not None and lora.dropout > 0:
            _, _, layer, _, name = module.split(".")  # model.layers.{l}.{self_attn|mlp}.{name}
            x = lora_dropout(h, lora, int(layer), LORA_TARGETS.index(name))
        y = y + F.linear(F.linear(x, a), b) * lora.scaling
    return y


def rms_norm(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_tables(cfg, seq_len, dtype):
    """cos/sin [T, head_dim] for positions 0..T-1; both halves of the last dim repeat the angles."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=dtype) / cfg.head_dim))
    if cfg.rope_llama3 is not None:
        # transformers' llama3 rope: long wavelengths slowed down by `factor`, short ones kept,
        # the band between interpolated smoothly.
        r = cfg.rope_llama3
        old_len = r["original_max_position_embeddings"]
        low_wavelen = old_len / r["low_freq_factor"]
        high_wavelen = old_len / r["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / r["factor"], inv_freq)
        smooth = (old_len / wavelen - r["low_freq_factor"]) / (r["high_freq_factor"] - r["low_freq_factor"])
        smoothed = (1 - smooth) * scaled / r["factor"] + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    angles = torch.arange(seq_len, dtype=dtype)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x, cos, sin):
    """x: [B, heads, T, head_dim]."""
    return x * cos + rotate_half(x) * sin


def attention(h, params, prefix, cfg, cos, sin, lora=None):
    batch, seq, _ = h.shape
    hd = cfg.head_dim

    def project(name, heads, norm=None):
        y = linear(h, params, prefix + name, lora, bias=cfg.attention_bias).view(batch, seq, heads, hd)
        if norm is not None:  # Qwen3: q_norm / k_norm over each head, before RoPE
            y = rms_norm(y, params[prefix + norm + ".weight"], cfg.rms_norm_eps)
        return y.transpose(1, 2)  # [B, heads, T, hd]

    q = apply_rope(project("q_proj", cfg.num_attention_heads, "q_norm" if cfg.qk_norm else None), cos, sin)
    k = apply_rope(project("k_proj", cfg.num_key_value_heads, "k_norm" if cfg.qk_norm else None), cos, sin)
    v = project("v_proj", cfg.num_key_value_heads)
    # GQA: query head j reads KV head j // group, i.e. each KV head serves `group` consecutive
    # query heads.
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)

    scores = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v  # [B, Hq, T, hd]
    out = out.transpose(1, 2).reshape(batch, seq, cfg.num_attention_heads * hd)
    return linear(out, params, prefix + "o_proj", lora)


def mlp(h, params, prefix, lora=None):
    gate = linear(h, params, prefix + "gate_proj", lora)
    up = linear(h, params, prefix + "up_proj", lora)
    return linear(F.silu(gate) * up, params, prefix + "down_proj", lora)


def forward(cfg, params, input_ids, lora=None):
    """input_ids: int64 [B, T]. Returns logits [B, T, V] in the parameters' dtype. `lora`: an
    optional LoraAdapter applied on top of the base linears."""
    embed = params["model.embed_tokens.weight"]
    x = F.embedding(input_ids, embed)
    cos, sin = rope_tables(cfg, input_ids.shape[1], embed.dtype)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms_norm(x, params[p + "input_layernorm.weight"], cfg.rms_norm_eps)
        x = x + attention(h, params, p + "self_attn.", cfg, cos, sin, lora)
        h = rms_norm(x, params[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        x = x + mlp(h, params, p + "mlp.", lora)
    x = rms_norm(x, params["model.norm.weight"], cfg.rms_norm_eps)
    head = embed if cfg.tie_word_embeddings else params["lm_head.weight"]
    return F.linear(x, head)


def causal_lm_loss(logits, labels):
    """HF ForCausalLMLoss: position t predicts labels[t + 1] of its row, the last position
    predicts nothing, IGNORE_INDEX targets are skipped, mean over the rest. With no target at
    all the mean is 0/0 = nan (and autograd then gives all-zero gradients)."""
    vocab = logits.shape[-1]
    return F.cross_entropy(logits[:, :-1, :].reshape(-1, vocab), labels[:, 1:].reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="mean")


def forward_backward(cfg, params, input_ids, labels, lora=None):
    """Returns (logits, loss) and leaves each parameter's gradient in .grad (of the base
    parameters that require grad, and of the adapter tensors). A tied model's embedding gradient
    sums the embedding and LM-head uses, since they are one tensor."""
    for p in list(params.values()) + (list(lora.weights.values()) if lora is not None else []):
        p.grad = None
    logits = forward(cfg, params, input_ids, lora)
    loss = causal_lm_loss(logits, labels)
    loss.backward()
    return logits, loss


# ---------------------------------------------------------------------------------------------
# subcommands
# ---------------------------------------------------------------------------------------------

def read_batch(path, vocab_size):
    """Reads {"input_ids": [[...]], "labels": [[...]]} (labels default to input_ids)."""
    with open(path) as f:
        doc = json.load(f)
    input_ids = doc["input_ids"]
    labels = doc.get("labels", input_ids)
    if not input_ids or len(labels) != len(input_ids):
        raise ValueError(f"{path}: need one labels row per input_ids row, and at least one row")
    seq = len(input_ids[0])
    if seq == 0 or any(len(row) != seq for row in input_ids + labels):
        raise ValueError(f"{path}: all input_ids and labels rows must have the same nonzero length")
    ids = torch.tensor(input_ids, dtype=torch.int64)
    lab = torch.tensor(labels, dtype=torch.int64)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(f"{path}: input_ids must lie in [0, {vocab_size})")
    valid = lab != IGNORE_INDEX
    if lab[valid].numel() and (lab[valid].min() < 0 or lab[valid].max() >= vocab_size):
        raise ValueError(f"{path}: labels must lie in [0, {vocab_size}) or be {IGNORE_INDEX}")
    return ids, lab


def dump(model_dir, input_path, out_path, dtype=torch.float32, adapter_dir=None, dropout_seed=None):
    """Computes logits, loss and gradients for one batch; writes them as F32 safetensors:
    `logits` [B, T, V], `loss` [], `grad.<name>` for every checkpoint parameter. With
    `adapter_dir` (a PEFT LoRA adapter) the base model is frozen and the gradients are those of
    the adapter tensors only, `grad.<PEFT tensor name>`. `dtype` is the compute dtype (base and
    adapter are upcast to it): float32 for the oracle; the --self-check of the comparison adds
    float64. `dropout_seed` (needs `adapter_dir`): apply the adapter's lora_dropout as in
    training, with the masks `memtune dump --dropout_seed` draws (lora_dropout_keep)."""
    if dropout_seed is not None and adapter_dir is None:
        raise ValueError("dropout_seed applies an adapter's lora_dropout: give adapter_dir")
    cfg, params = load_model(model_dir, dtype)
    lora = None
    trainable = params
    if adapter_dir is not None:
        lora = load_adapter(adapter_dir, cfg, dtype, dropout_seed)
        for p in params.values():
            p.requires_grad_(False)
        trainable = lora.weights
    input_ids, labels = read_batch(input_path, cfg.vocab_size)
    logits, loss = forward_backward(cfg, params, input_ids, labels, lora)
    out = {"logits": logits.detach(), "loss": loss.detach()}
    for name, p in trainable.items():
        out["grad." + name] = p.grad if p.grad is not None else torch.zeros_like(p)
    write_safetensors(out_path, {k: v.float() for k, v in out.items()})


def bench(model_dir, batch, seq, steps, threads):
    """Eager PyTorch training-step throughput: `steps` forward+backward passes on random tokens,
    the first one a warm-up that is not timed."""
    torch.set_num_threads(threads)
    cfg, params = load_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(cfg.vocab_size, (batch, seq), generator=gen)
    forward_backward(cfg, params, input_ids, input_ids)
    start = time.perf_counter()
    for _ in range(steps - 1):
        forward_backward(cfg, params, input_ids, input_ids)
    seconds_per_step = (time.perf_counter() - start) / (steps - 1)
    print(json.dumps({
        "tokens_per_s": batch * seq / seconds_per_step,
        "seconds_per_step": seconds_per_step,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": threads,
    }))


def hf_causal_lm_loss(logits, labels):
    """transformers' ForCausalLMLoss as the Trainer calls it: labels padded by one IGNORE_INDEX
    and shifted left (no copy of the logits), the logits flattened as a view, a summed
    cross-entropy divided by num_items_in_batch (the target tokens of the batch)."""
    vocab = logits.shape[-1]
    shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:].contiguous()
    num_items_in_batch = (shift_labels != IGNORE_INDEX).sum()
    loss = F.cross_entropy(logits.float().view(-1, vocab), shift_labels.view(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / num_items_in_batch


def new_lora_adapter(cfg, r, alpha, targets, gen):
    """A fresh PEFT-style adapter (init_lora_weights=True): lora_A kaiming-uniform with a =
    sqrt(5), i.e. U(-1/sqrt(in), 1/sqrt(in)); lora_B zeros; scaling alpha / r."""
    weights = {}
    for name, shape in lora_shapes(cfg, targets).items():
        if name.endswith(".lora_A.weight"):
            bound = 1.0 / math.sqrt(shape[1])
            weights[name] = torch.empty(r, shape[1]).uniform_(-bound, bound, generator=gen)
        else:
            weights[name] = torch.zeros(shape[0], r)
        weights[name].requires_grad_(True)
    return LoraAdapter(r, float(alpha), False, targets, alpha / r, weights)


def train_bench(model_dir, batch, seq, steps, threads, tuner, lora_rank, lora_alpha,
                target_modules, lr, device="cpu", autocast=None):
    """Eager PyTorch fine-tuning throughput, written the way a Hugging Face Trainer step runs:
    forward with materialized logits, ForCausalLMLoss, backward, clip_grad_norm_(1.0),
    AdamW.step, zero_grad(set_to_none=True); `steps` optimizer steps on one batch of random
    tokens (labels = input_ids), the first a warm-up that is not timed. tuner "full" trains
    every parameter in float32; "lora" freezes the base and trains fresh PEFT-style adapters.
    device "cuda" runs it on the GPU (the same float32 arithmetic; the weights, adapters and
    batch are made on the host with the same seeds, then moved). autocast "bf16" runs the forward
    and the loss under torch.autocast with bfloat16 (float32 weights, gradients and AdamW), as
    Trainer's bf16=True does."""
    torch.set_num_threads(threads)
    cfg, params = load_model(model_dir)
    gen = torch.Generator().manual_seed(0)
    lora = None
    if tuner != "full":
        for p in params.values():
            p.requires_grad_(False)
        lora = new_lora_adapter(cfg, lora_rank, lora_alpha, target_modules, gen)
    input_ids = torch.randint(cfg.vocab_size, (batch, seq), generator=gen)
    if device != "cpu":
        torch.set_default_device(device)  # what forward() makes (positions, masks) goes there too

        def moved(t):
            return t.detach().to(device).requires_grad_(t.requires_grad)

        params = {name: moved(p) for name, p in params.items()}
        if lora is not None:
            for name in list(lora.weights):
                lora.weights[name] = moved(lora.weights[name])
        input_ids = input_ids.to(device)
    trainable = list(params.values()) if tuner == "full" else list(lora.weights.values())
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    labels = input_ids.clone()
    synchronize = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def step():
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16, enabled=autocast == "bf16"):
            logits = forward(cfg, params, input_ids, lora)
            loss = hf_causal_lm_loss(logits, labels)
        del logits
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step()
    synchronize()
    start = time.perf_counter()
    for _ in range(steps - 1):
        step()
    synchronize()
    seconds_per_step = (time.perf_counter() - start) / (steps - 1)
    result = {
        "tokens_per_s": batch * seq / seconds_per_step,
        "seconds_per_step": seconds_per_step,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "threads": threads,
        "tuner": tuner,
        "device": device,
        "autocast": autocast,
        "trainable_parameters": sum(p.numel() for p in trainable),
    }
    if device.startswith("cuda"):
        result["device_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        result["device_name"] = torch.cuda.get_device_name()
    print(json.dumps(result))


def eval_bench(model_dir, batch, seq, num_sequences, threads, mode):
    """Eager PyTorch evaluation memory and time, written the way Hugging Face Trainer's
    evaluation_loop runs with a custom compute_metrics and eval_accumulation_steps=None:
    `num_sequences` random sequences (fixed seed, labels = input_ids) in batches of `batch` under
    torch.no_grad(). Per batch (prediction_step) the model computes float32 logits [B, T, V] and
    its mean causal-LM loss, which is kept as loss.repeat(B) (all_losses).
      mode "full":   the logits themselves are kept: HF's nested_concat grows one tensor with
                     torch.cat per batch (old and new copies coexist during each cat), and the
                     labels likewise. After the loop compute_metrics receives all of them
                     ([S, T, V] and [S, T], shared with numpy as HF's nested_numpify does) and
                     computes the token accuracy (argmax vs the labels shifted by one) and the
                     mean loss over all target tokens; that loss is computed sequence by
                     sequence, so the metric itself adds no full-size copy. eval_loss is that
                     compute_metrics loss.
      mode "argmax": preprocess_logits_for_metrics returns logits.argmax(-1), so only [B, T] ids
                     are kept; compute_metrics computes the token accuracy from them and
                     eval_loss is HF's: the mean of all_losses (the per-batch mean losses, each
                     repeated by its batch size).
    `seconds` covers the evaluation loop and compute_metrics, not loading the model. A full mode
    whose logits do not fit in memory fails as PyTorch fails (an allocation error, or the kernel
    ending the process)."""
    torch.set_num_threads(threads)
    cfg, params = load_model(model_dir)
    for p in params.values():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(cfg.vocab_size, (num_sequences, seq), generator=gen)

    def nested_concat(kept, new):
        # transformers' torch_pad_and_concatenate with equal sequence lengths: torch.cat on dim 0.
        return new if kept is None else torch.cat((kept, new), dim=0)

    def shifted_accuracy(preds, labels):
        # preds[:, t] predicts labels[:, t + 1]; IGNORE_INDEX targets are skipped.
        targets = labels[:, 1:]
        valid = targets != IGNORE_INDEX
        correct = (preds[:, :-1] == targets) & valid
        return correct.sum().item() / max(valid.sum().item(), 1)

    start = time.perf_counter()
    all_losses = all_preds = all_labels = None
    with torch.no_grad():
        for begin in range(0, num_sequences, batch):
            ids = input_ids[begin:begin + batch]
            labels = ids.clone()
            logits = forward(cfg, params, ids)  # [B, T, V] float32
            loss = hf_causal_lm_loss(logits, labels)  # mean over the batch's target tokens
            all_losses = nested_concat(all_losses, loss.repeat(ids.shape[0]))
            if mode == "argmax":
                logits = logits.argmax(-1)  # preprocess_logits_for_metrics
            all_preds = nested_concat(all_preds, logits)
            all_labels = nested_concat(all_labels, labels)
            del loss, logits, labels
        # nested_numpify: .numpy() of a CPU tensor shares its memory; compute_metrics gets arrays.
        predictions, label_ids = all_preds.numpy(), all_labels.numpy()
        preds_t, labels_t = torch.from_numpy(predictions), torch.from_numpy(label_ids)
        if mode == "full":
            accuracy = shifted_accuracy(preds_t.argmax(-1), labels_t)
            loss_sum, targets = 0.0, 0
            for i in range(preds_t.shape[0]):
                row = hf_causal_lm_loss(preds_t[i:i + 1], labels_t[i:i + 1])
                n = (labels_t[i, 1:] != IGNORE_INDEX).sum().item()
                loss_sum, targets = loss_sum + row.item() * n, targets + n
            eval_loss = loss_sum / max(targets, 1)
        else:
            accuracy = shifted_accuracy(preds_t, labels_t)
            eval_loss = all_losses.mean().item()
    seconds = time.perf_counter() - start
    print(json.dumps({
        "mode": mode,
        "seconds": seconds,
        "sequences_per_s": num_sequences / seconds,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "token_accuracy": accuracy,
        "eval_loss": eval_loss,
        "threads": threads,
    }))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_dump = sub.add_parser("dump", help="write logits, loss and gradients for one batch")
    p_dump.add_argument("--model", required=True, help="Hugging Face model directory")
    p_dump.add_argument("--input", required=True, help='JSON {"input_ids": [[...]], "labels": [[...]]}')
    p_dump.add_argument("--out", required=True, help="output .safetensors path")
    p_dump.add_argument("--adapter", help="PEFT LoRA adapter directory (adapter_config.json + "
                        "adapter_model.safetensors); gradients are then the adapter's only")
    p_dump.add_argument("--dropout_seed", type=int, help="apply the adapter's lora_dropout as in "
                        "training, with the masks `memtune dump --dropout_seed` draws from this seed")
    # The options every timed command shares.
    shape = argparse.ArgumentParser(add_help=False)
    shape.add_argument("--model", required=True)
    shape.add_argument("--batch", type=int, required=True)
    shape.add_argument("--seq", type=int, required=True)
    shape.add_argument("--threads", type=int, default=2)
    steps = argparse.ArgumentParser(add_help=False)
    steps.add_argument("--steps", type=int, required=True)
    sub.add_parser("bench", parents=[shape, steps], help="time eager forward+backward steps")
    p_train = sub.add_parser("train-bench", parents=[shape, steps], help="time eager fine-tuning steps "
                             "(forward, backward, clip, AdamW), full or LoRA")
    p_train.add_argument("--tuner", choices=("full", "lora"), default="lora")
    p_train.add_argument("--lora_rank", type=int, default=8)
    p_train.add_argument("--lora_alpha", type=float, default=32.0)
    p_train.add_argument("--target_modules", nargs="+", default=["all-linear"],
                         help=f"all-linear, or names among {list(LORA_TARGETS)}")
    p_train.add_argument("--lr", type=float, default=1e-4)
    p_train.add_argument("--device", default="cpu", help="cpu, or cuda to time the step on the GPU")
    p_train.add_argument("--autocast", choices=("bf16",), default=None,
                         help="the forward and loss under bfloat16 autocast (Trainer's bf16=True)")
    p_eval = sub.add_parser("eval-bench", parents=[shape], help="time and measure a Trainer-style "
                            "evaluation loop that keeps full logits or their argmax for compute_metrics")
    p_eval.add_argument("--num_sequences", type=int, required=True)
    p_eval.add_argument("--mode", choices=("full", "argmax"), default="full")
    args = parser.parse_args(argv)
    timed = args.command in ("bench", "train-bench")
    if timed and min(args.batch, args.seq, args.threads) < 1:
        parser.error(f"{args.command}: --batch, --seq and --threads must be positive")
    if timed and args.steps < 2:
        parser.error(f"{args.command}: --steps must be >= 2 (the first step is an untimed warm-up)")
    if args.command == "train-bench":
        if args.lora_rank < 1:
            parser.error("train-bench: --lora_rank must be positive")
        targets = args.target_modules
        if targets == ["all-linear"]:
            targets = list(LORA_TARGETS)
        if any(t not in LORA_TARGETS for t in targets) or len(set(targets)) != len(targets):
            parser.error(f"train-bench: --target_modules must be all-linear or distinct names "
                         f"among {list(LORA_TARGETS)}")
        args.target_modules = tuple(t for t in LORA_TARGETS if t in targets)
    if args.command == "dump" and args.dropout_seed is not None and not 0 <= args.dropout_seed < 2**64:
        parser.error("dump: --dropout_seed must be in [0, 2^64)")
    if args.command == "eval-bench":
        if min(args.batch, args.num_sequences, args.threads) < 1 or args.seq < 2:
            parser.error("eval-bench: --batch, --num_sequences and --threads must be positive, "
                         "--seq at least 2")
    try:
        if args.command == "dump":
            dump(args.model, args.input, args.out, adapter_dir=args.adapter, dropout_seed=args.dropout_seed)
        elif args.command == "bench":
            bench(args.model, args.batch, args.seq, args.steps, args.threads)
        elif args.command == "eval-bench":
            eval_bench(args.model, args.batch, args.seq, args.num_sequences, args.threads,
                       args.mode)
        else:
            train_bench(args.model, args.batch, args.seq, args.steps, args.threads, args.tuner,
                        args.lora_rank, args.lora_alpha, args.target_modules, args.lr, args.device,
                        args.autocast)
    except (ValueError, KeyError, OSError) as e:
        sys.exit(f"qwen2_reference: error: {e}")


if __name__ == "__main__":
    main(sys.argv[1:])
