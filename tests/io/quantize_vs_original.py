#!/usr/bin/python3
"""Checks `memtune quantize` against the ORIGINAL float weights, not against its own dequantize.

    /usr/bin/python3 tests/io/quantize_vs_original.py --memtune BIN --workdir DIR [--break MODE]

A quantizer whose scales are wrong but self-consistent (quantize and dequantize agree with each
other) passes a round-trip test. This test reads the packed files itself (its own safetensors
parser and the GPTQ / AWQ unpacking of tests/io/quantized_vectors.py, written from the formats'
description) and compares them with the float checkpoint they were made from:

  1. A small Qwen2 model (tiny preset, hidden 128, intermediate 256, 2 layers, so every linear
     layer has 128 or 256 inputs = 2 or 4 groups of 64) with a byte-level tokenizer written here,
     trained for a few steps on the Debian package descriptions of examples/debian-sections so
     that its weights are not the init's Gaussian.
  2. `memtune quantize --group_size 64` makes: RTN int8 and int4 (GPTQ files, symmetric), GPTQ
     int8, int4, int4 with act-order, and the AWQ file (4 bits, zero points) by RTN and by GPTQ;
     and GPTQ files whose LM head is packed too (--lm_head_bits; the tied head becomes
     lm_head.qweight, the embedding stays as it was): RTN int4 layers with an 8-bit head and with
     a 4-bit one, GPTQ int4 layers with an 8-bit head.
  3. RTN, against the definition memtune documents (src/model/quantize.cpp, AutoGPTQ's
     quantizer): per output row and group of 64 inputs, lo = min(0, min w), hi = max(0, max w);
     symmetric (GPTQ files): hi = max(-lo, hi), lo = -hi, zero = 2^(bits-1); asymmetric (AWQ):
     zero = round(-lo / scale); scale = float16((hi - lo) / (2^bits - 1)) in float32. A packed
     LM head is checked the same way (symmetric, its own bits, the layers' group size), whatever
     method made the layers.
     (a) every stored scale within 1 float16 ulp of that, every zero equal to it;
     (b) every element |w - dequantized| <= (1/2 + 2^-15) scale (float32 division slack), except
         elements outside the code range's half-step margin [(-zero - 1/2) s, (maxq - zero + 1/2) s]
         (only the float16 rounding of the scale can put a group's extreme there): those
         <= (1/2 + maxq 2^-11 + 2^-15) s, as float16 rounding moves the range end by at most
         maxq 2^-11 s.
  4. GPTQ, against the quantity it minimizes: the layer-wise output error
     E(Wq) = ||X W^T - X Wq^T||_F^2 = tr((W - Wq) H (W - Wq)^T), H = X^T X summed over the
     calibration tokens, X the layer's inputs in the FLOAT model (memtune collects every layer's
     Hessian from the float model in one pass; the activations here come from the PyTorch
     reference, tools/qwen2_reference.py, in float64, on the calibration text tokenized by
     `memtune tokenize`, cut to --max_length as quantize does). For each linear layer (7 per
     decoder layer, num_hidden_layers from config.json),
     E_gptq <= GPTQ_VS_RTN_MAX x E_rtn (same bits and file format), summed over the layers
     <= GPTQ_VS_RTN_SUM_MAX x, and E_gptq / ||X W^T||^2 below REL_OUTPUT_ERROR_MAX[bits]; the same
     on the held-out texts' inputs (GPTQ_HELD_OUT_MAX, GPTQ_HELD_OUT_SUM_MAX), which GPTQ never saw.
     Structure: symmetric files' zeros all 2^(bits-1); g_idx = k // 64, or with act-order an
     assignment with exactly 64 inputs per group; scales finite and positive.
  5. The AWQ file format: memtune has no AWQ algorithm (no activation-aware channel scaling);
     `--format awq` is the AWQ layout with asymmetric zero points, filled by RTN or GPTQ. Its RTN
     file is checked as in 3 (asymmetric), its GPTQ file as in 4 against it.
  6. Perplexity (`memtune eval` on 40 held-out descriptions, 9770 byte tokens): every quantized
     model within PPL_MAX_REL[(bits, method)] of the float model's perplexity. On this small model
     perplexity is a weak detector (scales x 1.1 move it by 0.2% at most); 3-5 are the sharp checks.
  7. Non-quantized tensors (embeddings, norms, biases) copied unchanged, no tensor missing or
     extra; config.json's quantization_config says what was asked (with a packed head: "lm_head"
     true, "lm_head_bits" where it differs from "bits", tie_word_embeddings false).
  8. The checker checks itself: a self-consistent RTN file with doubled scales (re-quantized from
     the original weights), scales x 1.1, zero points + 1 (each on the layers and on the packed
     heads), and GPTQ files replaced by the RTN ones are each simulated in memory and must be
     caught, or the test fails.
A NaN or an infinity in the original or the dequantized weights, or in a ratio of errors, fails.

--break MODE corrupts the quantized files on disk after `memtune quantize` (scale_x1.1,
zero_plus1, double_scale_consistent, gptq_as_rtn) so that every check, perplexity included,
sees a broken quantizer; the run must then fail.

Exit status 0 only if every check passes.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tools"))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
import quantized_vectors as qv  # noqa: E402
from numeric import difference  # noqa: E402

SUBPROCESS_TIMEOUT_S = 240
GROUP = 64
SEED = 3
TRAIN_STEPS = 100
TRAIN_TEXTS = 400
CALIBRATION_TEXTS = 32
CALIBRATION_MAX_LENGTH = 128
EVAL_TEXTS = 40
EVAL_MAX_LENGTH = 256

# Half a step of slack for float32 arithmetic in w / scale (codes up to 255: half an ulp of 256 is
# 2^-16), and the float16 rounding of the scale (relative 2^-11) times the largest code distance.
DIVISION_SLACK = 2.0 ** -15
F16_REL = 2.0 ** -11

# GPTQ vs RTN, layer-wise output error E on the calibration inputs, E_gptq / E_rtn. Measured on
# this model (seeds 3, 5, 11; 100 steps): per layer at most 0.104, over all layers at most 0.036
# (the activations of a small, briefly trained byte-level model are far from isotropic: layer 0's
# q/k/v inputs span 75 of 128 dimensions, down_proj's 64 of 256, and GPTQ moves the rounding
# error into the directions the data does not use; the worst layers are layer 0's q/k/v at
# 0.07-0.10). The bounds are ~3-4x those: GPTQ that does nothing (ratio 1) or compensates only
# part of the error fails.
GPTQ_VS_RTN_MAX = 0.3
GPTQ_VS_RTN_SUM_MAX = 0.15
# The same on the held-out texts' inputs (GPTQ never saw them). Measured: at most 0.108 per layer,
# 0.037 over all layers.
GPTQ_HELD_OUT_MAX = 0.35
GPTQ_HELD_OUT_SUM_MAX = 0.2
# Absolute bound on GPTQ's E / ||X W^T||^2 per layer. Measured maxima (calibration and held out):
# int8 3.1e-7, int4 8.9e-5; RTN's own are int8 4e-6 - 7e-6, int4 1.1e-3 - 2.8e-3. The bounds are
# ~6x GPTQ's measured maxima and below RTN's values.
REL_OUTPUT_ERROR_MAX = {8: 2e-6, 4: 5e-4}
# Perplexity relative to the float model's, |ppl_q / ppl_f - 1|, by (bits, method). Measured
# (seeds 3, 5, 11): int8 at most 0.0043%; int4 RTN 0.15% (GPTQ file) and 0.17% (AWQ file); int4
# GPTQ at most 0.03%. README's bench on a 20M model: int4 RTN +0.27%, GPTQ +0.04%. Bounds ~6-10x
# the measured values. A packed head takes the bound of the lower of its bits and the layers'
# (seed 3: int4 RTN layers with an 8-bit head +0.16%, with a 4-bit head +0.35%; int4 GPTQ layers
# with an 8-bit head +0.04%).
PPL_MAX_REL = {(8, "rtn"): 0.0005, (8, "gptq"): 0.0005, (4, "rtn"): 0.01, (4, "gptq"): 0.003}

VARIANTS = [  # name, quantize flags, bits, file format, method, act-order
    ("rtn8", ["--bits", "8"], 8, "gptq", "rtn", False),
    ("rtn4", ["--bits", "4"], 4, "gptq", "rtn", False),
    ("gptq8", ["--bits", "8", "--method", "gptq"], 8, "gptq", "gptq", False),
    ("gptq4", ["--bits", "4", "--method", "gptq"], 4, "gptq", "gptq", False),
    ("gptq4_act", ["--bits", "4", "--method", "gptq", "--act_order"], 4, "gptq", "gptq", True),
    ("awq_rtn", ["--format", "awq"], 4, "awq", "rtn", False),
    ("awq_gptq", ["--format", "awq", "--method", "gptq"], 4, "awq", "gptq", False),
    ("rtn4_head8", ["--bits", "4", "--lm_head_bits", "8"], 4, "gptq", "rtn", False),
    ("rtn4_head4", ["--bits", "4", "--lm_head_bits", "4"], 4, "gptq", "rtn", False),
    ("gptq4_head8", ["--bits", "4", "--method", "gptq", "--lm_head_bits", "8"], 4, "gptq", "gptq", False),
]
VARIANT = {v[0]: v for v in VARIANTS}
# The variants whose LM head is packed too, and its bits.
HEAD_BITS = {"rtn4_head8": 8, "rtn4_head4": 4, "gptq4_head8": 8}
RTN_OF = {"gptq8": "rtn8", "gptq4": "rtn4", "gptq4_act": "rtn4", "awq_gptq": "awq_rtn", "gptq4_head8": "rtn4_head8"}
LINEAR_PER_DECODER_LAYER = 7  # q, k, v, o, gate, up, down
BREAK_MODES = ["scale_x1.1", "zero_plus1", "double_scale_consistent", "gptq_as_rtn"]


class Failure(Exception):
    pass


def run(cmd):
    # OpenMP threads that sleep rather than spin when they wait: on a busy machine spinning threads
    # make memtune many times slower.
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        raise Failure(f"timed out after {SUBPROCESS_TIMEOUT_S} s: {' '.join(cmd)}")
    except OSError as e:
        raise Failure(f"cannot run {cmd[0]}: {e}")
    if proc.returncode != 0:
        raise Failure(f"exit status {proc.returncode}: {' '.join(cmd)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc.stdout


# ---------------------------------------------------------------------------------------------
# the model, its tokenizer and data
# ---------------------------------------------------------------------------------------------

def gpt2_byte_chars():
    """GPT-2's printable stand-in for each byte, indexed by token id (as tests/data/synthetic_tokenizer.h)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for c in cs]


def write_byte_tokenizer(model_dir):
    """A byte-level BPE tokenizer without merges: one token per UTF-8 byte (ids 0-255), then
    <|endoftext|>, <|im_start|>, <|im_end|>."""
    vocab = {t: i for i, t in enumerate(gpt2_byte_chars())}
    added = [{"id": 256 + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": byte_level, "post_processor": byte_level, "decoder": byte_level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                     "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": vocab, "merges": []}}
    with open(os.path.join(model_dir, "tokenizer.json"), "w") as f:
        json.dump(doc, f)
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"pad_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "model_max_length": 32768}, f)


def texts(split, n):
    out = []
    with open(os.path.join(ROOT, "examples", "debian-sections", f"{split}.jsonl")) as f:
        for line in f:
            if len(out) == n:
                break
            out.append(json.loads(line)["text"])
    if len(out) != n:
        raise Failure(f"examples/debian-sections/{split}.jsonl has fewer than {n} lines")
    return out


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def prepare(memtune, work):
    init, trained = os.path.join(work, "init"), os.path.join(work, "trained")
    run([memtune, "init-model", "--preset", "tiny", "--set", "hidden_size=128", "--set", "intermediate_size=256",
         "--seed", str(SEED), "--out", init])
    write_byte_tokenizer(init)
    train_texts = texts("train", TRAIN_TEXTS)
    write_jsonl(os.path.join(work, "train.jsonl"), [{"text": t} for t in train_texts])
    write_jsonl(os.path.join(work, "calibration.jsonl"), [{"text": t} for t in train_texts[:CALIBRATION_TEXTS]])
    write_jsonl(os.path.join(work, "eval.jsonl"), [{"text": t} for t in texts("eval", EVAL_TEXTS)])
    run([memtune, "train", "--model_name_or_path", init, "--train_file", os.path.join(work, "train.jsonl"),
         "--output_dir", trained, "--tuner_type", "full", "--max_steps", str(TRAIN_STEPS),
         "--per_device_train_batch_size", "8", "--max_length", "128", "--truncation_strategy", "right",
         "--learning_rate", "3e-3", "--lr_scheduler_type", "cosine", "--warmup_ratio", "0.05",
         "--logging_steps", str(TRAIN_STEPS), "--save_strategy", "no", "--seed", "7"])
    return trained


def quantize_all(memtune, work, trained):
    for name, flags, _, _, method, _ in VARIANTS:
        extra = []
        if method == "gptq":
            extra = ["--calibration_file", os.path.join(work, "calibration.jsonl"), "--num_samples",
                     str(CALIBRATION_TEXTS), "--max_length", str(CALIBRATION_MAX_LENGTH)]
        run([memtune, "quantize", "--model", trained, "--out", os.path.join(work, name), "--group_size", str(GROUP)]
            + flags + extra)


# ---------------------------------------------------------------------------------------------
# reading the packed files
# ---------------------------------------------------------------------------------------------

class Layer:
    """One quantized linear layer as stored: codes [in, out], zeros and scales [groups, out] (the
    zero as the dequantization uses it), g [in] the group of each input."""

    def __init__(self, codes, zeros, scales_f16, g, bits):
        self.codes, self.zeros, self.scales_f16, self.g, self.bits = codes, zeros, scales_f16, g, bits

    @property
    def maxq(self):
        return (1 << self.bits) - 1

    @property
    def scales(self):
        return self.scales_f16.astype(np.float64)

    def dequantized(self):
        """[out, in] in float64 (the float32 products memtune forms, exactly)."""
        return (self.scales[self.g] * (self.codes.astype(np.float64) - self.zeros[self.g])).T


def linear_layers(model_dir):
    """The linear layers memtune quantize packs in the model of model_dir: 7 per decoder layer."""
    config = json.load(open(os.path.join(model_dir, "config.json")))
    return LINEAR_PER_DECODER_LAYER * int(config["num_hidden_layers"])


def head_weight(floats):
    """The float LM head [vocab, hidden]: lm_head.weight, or the embedding it is tied to."""
    return floats["lm_head.weight"] if "lm_head.weight" in floats else floats["model.embed_tokens.weight"]


def read_quantized(model_dir, fmt, bits, floats, n_linear, head_bits=0):
    """(config.json, {base: Layer}, problems). n_linear: the decoder's linear layers; head_bits: the
    packed LM head's bits (lm_head.*, its float weight the untied head or the embedding), or 0."""
    config = json.load(open(os.path.join(model_dir, "config.json")))
    tensors = qv.read_safetensors(os.path.join(model_dir, "model.safetensors"))
    layers = {}
    problems = []
    packed_names = (".qweight", ".qzeros", ".scales", ".g_idx") if fmt == "gptq" else (".qweight", ".qzeros", ".scales")
    sources = dict(floats)
    if head_bits:
        sources["lm_head.weight"] = head_weight(floats)
    expected_tensors = set()
    for name, ref in sources.items():
        base = name[:-len(".weight")] if name.endswith(".weight") else None
        if base is None or base + ".qweight" not in tensors:
            expected_tensors.add(name)
            if name not in tensors or not np.array_equal(tensors[name].astype(np.float32), ref.astype(np.float32)):
                problems.append(f"{name}: not copied unchanged")
            continue
        expected_tensors.update(base + suffix for suffix in packed_names)
        b = head_bits if base == "lm_head" else bits
        if base == "lm_head" and not head_bits:
            problems.append("lm_head: packed, but the variant keeps the LM head in the model's dtype")
            continue
        scales = np.array(tensors[base + ".scales"], dtype=np.float16)
        if fmt == "gptq":
            codes = qv.unpack_rows(tensors[base + ".qweight"], b).astype(np.int64)
            zeros = qv.unpack_cols(tensors[base + ".qzeros"], b).astype(np.float64) + 1
            g = tensors[base + ".g_idx"].astype(np.int64)
        else:
            codes = qv.awq_unpack(tensors[base + ".qweight"]).astype(np.int64)
            zeros = qv.awq_unpack(tensors[base + ".qzeros"]).astype(np.float64)
            g = np.arange(codes.shape[0]) // GROUP
        if codes.shape != (ref.shape[1], ref.shape[0]) or scales.shape != zeros.shape or scales.shape[1] != ref.shape[0]:
            problems.append(f"{base}: packed shapes {codes.shape} / {scales.shape} do not fit {ref.shape}")
            continue
        layers[base] = Layer(codes, zeros, scales, g, b)
    if sorted(set(tensors) - expected_tensors):
        problems.append(f"{model_dir}: unexpected tensors {sorted(set(tensors) - expected_tensors)}")
    decoder = [n for n in layers if n.startswith("model.layers.")]
    if len(decoder) != n_linear:
        problems.append(f"{model_dir}: {len(decoder)} quantized decoder layers, expected {n_linear}")
    if bool(head_bits) != ("lm_head" in layers):
        problems.append(f"{model_dir}: the LM head is {'not ' if head_bits else ''}packed, "
                        f"{'expected' if head_bits else 'not expected'} with --lm_head_bits {head_bits}")
    return config, layers, problems


def check_config(name, doc, fmt, bits, act_order, head_bits=0):
    config = doc["quantization_config"]
    want = {"quant_method": fmt, "bits": bits, "group_size": GROUP}
    if fmt == "gptq":
        want.update(sym=True, desc_act=act_order)
    else:
        want.update(zero_point=True, version="gemm")
    fails = [f"{name}: quantization_config.{k} is {config.get(k)!r}, asked {v!r}" for k, v in want.items()
             if config.get(k) != v]
    # A packed head: "lm_head" true, its bits in "lm_head_bits" where they differ from the layers'.
    if config.get("lm_head", False) is not bool(head_bits):
        fails.append(f"{name}: quantization_config.lm_head is {config.get('lm_head')!r}, expected {bool(head_bits)}")
    if config.get("lm_head_bits", bits if head_bits else None) != (head_bits or None):
        fails.append(f"{name}: quantization_config.lm_head_bits is {config.get('lm_head_bits')!r} for a "
                     f"{head_bits or 'float'}-bit head and {bits}-bit layers")
    if head_bits and doc.get("tie_word_embeddings") is not False:
        fails.append(f"{name}: tie_word_embeddings is {doc.get('tie_word_embeddings')!r} with a packed head "
                     "(lm_head.qweight is a tensor of its own), expected false")
    return fails


# ---------------------------------------------------------------------------------------------
# the checks; each returns a list of failures and records what it measured in `stats`
# ---------------------------------------------------------------------------------------------

def rtn_definition(w, bits, sym):
    """Scale (float16) and zero per [out, group] of w [out, in] by RTN's definition."""
    maxq = (1 << bits) - 1
    x = w.astype(np.float32).reshape(w.shape[0], -1, GROUP)
    lo = np.minimum(np.float32(0), x.min(axis=2))
    hi = np.maximum(np.float32(0), x.max(axis=2))
    if sym:
        hi = np.maximum(-lo, hi)
        lo = -hi
    both_zero = (lo == 0) & (hi == 0)
    lo = np.where(both_zero, np.float32(-1), lo)
    hi = np.where(both_zero, np.float32(1), hi)
    scale = ((hi - lo) / np.float32(maxq)).astype(np.float16)
    scale = np.where(scale == 0, np.float16(6.1e-5), scale)
    if sym:
        zero = np.full(scale.shape, (maxq + 1) / 2)
    else:
        ratio = (-lo / scale.astype(np.float32)).astype(np.float32)
        zero = np.floor(ratio.astype(np.float64) + 0.5)  # std::round of a value >= 0
    return scale, zero


def check_rtn(tag, w, layer, sym, stats):
    fails = []
    in_features = w.shape[1]
    if not np.array_equal(layer.g, np.arange(in_features) // GROUP):
        return [f"{tag}: g_idx is not k // {GROUP}"]
    scale_def, zero_def = rtn_definition(w, layer.bits, sym)  # [out, groups]
    stored = layer.scales_f16.T  # [out, groups]
    # A NaN or an infinity in a scale, the original or the dequantized weights fails here (the
    # comparisons below would let a NaN through).
    for what, got, want in (("stored scales [row, group] against RTN's definition", stored, scale_def),
                            ("dequantized [row, input] against the original", layer.dequantized(), w)):
        d = difference(got, want)
        if d.problem:
            return [f"{tag}: {what}: {d.problem}"]
    ulps = np.abs(stored.view(np.uint16).astype(np.int64) - scale_def.view(np.uint16).astype(np.int64))
    stats["scale_max_ulp"] = max(stats.get("scale_max_ulp", 0), int(ulps.max()))
    stats["scales"] = stats.get("scales", 0) + ulps.size
    stats["scales_exact"] = stats.get("scales_exact", 0) + int((ulps == 0).sum())
    if ulps.max() > 1:
        k = np.unravel_index(np.argmax(ulps), ulps.shape)
        fails.append(f"{tag}: scale of row {k[0]} group {k[1]} is {float(stored[k]):.6g}, RTN's definition gives "
                     f"{float(scale_def[k]):.6g} ({int((ulps > 1).sum())} of {ulps.size} scales off by > 1 ulp)")
    zeros = layer.zeros.T
    bad_zero = zeros != zero_def
    if bad_zero.any():
        k = np.unravel_index(np.argmax(bad_zero), bad_zero.shape)
        fails.append(f"{tag}: zero of row {k[0]} group {k[1]} is {zeros[k]:g}, RTN's definition gives "
                     f"{zero_def[k]:g} ({int(bad_zero.sum())} of {bad_zero.size} zeros differ)")
    # Elements against half a step of their own group's stored scale.
    s = layer.scales[layer.g].T  # [out, in]
    z = layer.zeros[layer.g].T
    w64 = w.astype(np.float64)
    err = np.abs(w64 - layer.dequantized()) / s
    inside = (w64 >= (-z - 0.5) * s) & (w64 <= (layer.maxq - z + 0.5) * s)
    bound_in = 0.5 + DIVISION_SLACK
    bound_out = 0.5 + layer.maxq * F16_REL + DIVISION_SLACK
    stats["elements"] = stats.get("elements", 0) + err.size
    stats["outside"] = stats.get("outside", 0) + int((~inside).sum())
    if inside.any():
        stats["max_err_in_steps"] = max(stats.get("max_err_in_steps", 0.0), float(err[inside].max()))
    if (~inside).any():
        stats["max_err_out_steps"] = max(stats.get("max_err_out_steps", 0.0), float(err[~inside].max()))
    # Written so that a NaN error (a zero scale) is over too.
    over = ~np.where(inside, err <= bound_in, err <= bound_out)
    if over.any():
        k = np.unravel_index(np.argmax(np.where(over, np.nan_to_num(err, nan=np.inf), -1)), err.shape)
        fails.append(f"{tag}: {int(over.sum())} of {err.size} elements further than half a step from the original; "
                     f"worst [{k[0]}, {k[1]}]: w {w64[k]:.6g}, dequantized {layer.dequantized()[k]:.6g}, "
                     f"{err[k]:.4f} steps of {s[k]:.4g}")
    return fails


def rtn_summary(stats, bits):
    """One line of what check_rtn measured (NaN where a check stopped early)."""
    nan = float("nan")
    return (f"scales {stats.get('scales_exact', 0)}/{stats.get('scales', 0)} equal to the definition (max "
            f"{stats.get('scale_max_ulp', nan)} ulp, bound 1); max |w - deq| {stats.get('max_err_in_steps', nan):.5f} "
            f"steps (bound {0.5 + DIVISION_SLACK:.5f}); {stats.get('outside', 0)} of {stats.get('elements', 0)} elements "
            f"past the range's half-step margin, max {stats.get('max_err_out_steps', 0):.5f} steps (bound "
            f"{0.5 + ((1 << bits) - 1) * F16_REL + DIVISION_SLACK:.5f})")


def check_structure(tag, layer, fmt, act_order):
    fails = []
    if not np.all(np.isfinite(layer.scales)) or not np.all(layer.scales > 0):
        fails.append(f"{tag}: scales not all finite and positive")
    if fmt == "gptq" and not np.all(layer.zeros == (layer.maxq + 1) / 2):
        fails.append(f"{tag}: a symmetric file's zero points are not all {(layer.maxq + 1) // 2}")
    if fmt == "awq" and not np.all((layer.zeros >= 0) & (layer.zeros <= layer.maxq)):
        fails.append(f"{tag}: zero points outside [0, {layer.maxq}]")
    groups = layer.scales.shape[0]
    if act_order:
        counts = np.bincount(layer.g, minlength=groups) if layer.g.min() >= 0 else None
        if counts is None or len(counts) != groups or not np.all(counts == GROUP):
            fails.append(f"{tag}: act-order g_idx does not give every group {GROUP} inputs")
    elif not np.array_equal(layer.g, np.arange(layer.codes.shape[0]) // GROUP):
        fails.append(f"{tag}: g_idx is not k // {GROUP}")
    return fails


def output_error(w, wq, hessian):
    d = w.astype(np.float64) - wq
    return float(((d @ hessian) * d).sum())


def check_gptq_vs_rtn(tag, w_by_layer, gptq_layers, rtn_layers, hessians, bits, stats,
                      layer_max=None, sum_max=None, what="output error"):
    layer_max = GPTQ_VS_RTN_MAX if layer_max is None else layer_max
    sum_max = GPTQ_VS_RTN_SUM_MAX if sum_max is None else sum_max
    fails = []
    ratios, total_g, total_r = [], 0.0, 0.0
    worst_rel = 0.0
    for base, w in w_by_layer.items():
        h = hessians[base]
        # A NaN or an infinity in either operand fails (the ratios below would carry it through
        # comparisons that a NaN passes).
        nonfinite = [(kind, d.problem) for kind, layer in (("GPTQ", gptq_layers[base]), ("RTN", rtn_layers[base]))
                     for d in [difference(layer.dequantized(), w)] if d.problem]
        if nonfinite:
            fails += [f"{tag}: {base}: {kind}'s dequantized [row, input] against the original: {problem}"
                      for kind, problem in nonfinite]
            continue
        e_g = output_error(w, gptq_layers[base].dequantized(), h)
        e_r = output_error(w, rtn_layers[base].dequantized(), h)
        signal = output_error(w, np.zeros_like(w, dtype=np.float64), h)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio, rel = np.float64(e_g) / e_r, np.float64(e_g) / signal
        ratios.append(ratio)
        total_g += e_g
        total_r += e_r
        worst_rel = max(worst_rel, rel)
        if not ratio <= layer_max:
            fails.append(f"{tag}: {base}: GPTQ's {what} {e_g:.4g} is {ratio:.3f} x RTN's {e_r:.4g} "
                         f"(at most {layer_max})")
        if not rel <= REL_OUTPUT_ERROR_MAX[bits]:
            fails.append(f"{tag}: {base}: GPTQ's {what} is {rel:.3g} of ||XW^T||^2 "
                         f"(at most {REL_OUTPUT_ERROR_MAX[bits]:g})")
    if not ratios:
        stats.update(ratio_min=np.nan, ratio_max=np.nan, ratio_sum=np.nan, rel_max=np.nan)
        return fails
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio_sum = np.float64(total_g) / total_r
    stats.update(ratio_min=min(ratios), ratio_max=max(ratios), ratio_sum=ratio_sum, rel_max=worst_rel)
    if not ratio_sum <= sum_max:
        fails.append(f"{tag}: GPTQ's {what} over all layers is {ratio_sum:.3f} x RTN's "
                     f"(at most {sum_max})")
    return fails


def rtn_rel_output_error(w_by_layer, layers, hessians):
    return max(output_error(w, layers[b].dequantized(), hessians[b]) /
               output_error(w, np.zeros_like(w, dtype=np.float64), hessians[b]) for b, w in w_by_layer.items())


# ---------------------------------------------------------------------------------------------
# the calibration activations (PyTorch reference, float64)
# ---------------------------------------------------------------------------------------------

def input_hessians(memtune, work, trained, split, max_length, expected):
    """H = X^T X per linear layer over the tokens of work/<split>.jsonl (each text cut to
    max_length tokens, as quantize does), X the layer's input in the float model."""
    import torch
    import qwen2_reference as ref

    strings = os.path.join(work, f"{split}_strings.jsonl")
    write_jsonl(strings, [json.loads(line)["text"] for line in open(os.path.join(work, f"{split}.jsonl"))])
    ids = [json.loads(line) for line in run([memtune, "tokenize", "--tokenizer", trained, "--input", strings]).splitlines()
           if line.strip()]
    ids = [seq[:max_length] for seq in ids if len(seq) >= 2]
    if len(ids) != expected:
        raise Failure(f"tokenize gave {len(ids)} {split} sequences, expected {expected}")
    cfg, params = ref.load_model(trained, dtype=torch.float64)
    hessians = {}
    plain_linear = ref.linear

    def observed(h, params_, module, lora, bias=False):
        x = h.reshape(-1, h.shape[-1])
        hessians[module] = hessians.get(module, 0) + (x.T @ x).numpy()
        return plain_linear(h, params_, module, lora, bias)

    ref.linear = observed
    try:
        with torch.no_grad():
            for seq in ids:
                ref.forward(cfg, params, torch.tensor([seq], dtype=torch.int64))
    finally:
        ref.linear = plain_linear
    return hessians, sum(len(s) for s in ids)


# ---------------------------------------------------------------------------------------------
# broken quantizers: in memory (the checker checks itself) and on disk (--break)
# ---------------------------------------------------------------------------------------------

def requantized(w, layer, scale_f16, zero):
    """A self-consistent RTN layer with the given scales / zeros [out, groups]: codes from the original w."""
    s = scale_f16.astype(np.float32)[:, layer.g]  # [out, in]
    z = zero[:, layer.g]
    codes = np.clip(np.floor(w.astype(np.float32) / s + 0.5) + z, 0, layer.maxq).astype(np.int64)
    return Layer(codes.T.copy(), zero.T.astype(np.float64), scale_f16.T.copy(), layer.g, layer.bits)


def broken(mode, w, layer, rtn_layer=None):
    if mode == "scale_x1.1":
        return Layer(layer.codes, layer.zeros, (layer.scales * 1.1).astype(np.float16), layer.g, layer.bits)
    if mode == "zero_plus1":
        return Layer(layer.codes, np.minimum(layer.zeros + 1, layer.maxq + 1), layer.scales_f16, layer.g, layer.bits)
    if mode == "double_scale_consistent":
        return requantized(w, layer, (layer.scales_f16.T.astype(np.float32) * 2).astype(np.float16), layer.zeros.T)
    if mode == "gptq_as_rtn":
        return rtn_layer if rtn_layer is not None else layer
    raise ValueError(mode)


def self_check(floats_by_layer, head, results, hessians):
    """Each simulated broken quantizer must be caught by the checks that exist for it."""
    fails = []
    caught = {}
    for mode in ["scale_x1.1", "zero_plus1", "double_scale_consistent"]:
        for name, sym in (("rtn4", True), ("rtn8", True), ("awq_rtn", False)):
            found = []
            for base, w in floats_by_layer.items():
                found += check_rtn(base, w, broken(mode, w, results[name][base]), sym, {})
            caught[f"{mode}/{name}"] = len(found)
            if not found:
                fails.append(f"self-check: {mode} on {name} was not caught")
        for name in HEAD_BITS:
            if "lm_head" not in results[name]:
                continue  # reading it failed, and said so
            found = check_rtn("lm_head", head, broken(mode, head, results[name]["lm_head"]), True, {})
            caught[f"{mode}/{name}.lm_head"] = len(found)
            if not found:
                fails.append(f"self-check: {mode} on {name}'s packed LM head was not caught")
    for name, rtn in RTN_OF.items():
        fake = {b: broken("gptq_as_rtn", w, results[name][b], results[rtn][b]) for b, w in floats_by_layer.items()}
        found = check_gptq_vs_rtn(name, floats_by_layer, fake, results[rtn], hessians, VARIANT[name][2], {})
        caught[f"gptq_as_rtn/{name}"] = len(found)
        if not found:
            fails.append(f"self-check: gptq_as_rtn on {name} was not caught")
    return fails, caught


def rewrite_tensors(path, arrays):
    """Overwrites tensors in place (same dtype and shape)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        for name, a in arrays.items():
            begin, end = header[name]["data_offsets"]
            data = np.ascontiguousarray(a).tobytes()
            if len(data) != end - begin:
                raise Failure(f"{path}: {name}: {len(data)} bytes for {end - begin}")
            f.seek(8 + n + begin)
            f.write(data)


def break_on_disk(mode, work, floats, n_linear):
    for name, _, bits, fmt, method, _ in VARIANTS:
        path = os.path.join(work, name, "model.safetensors")
        if mode == "gptq_as_rtn":
            if method == "gptq":
                shutil.copyfile(os.path.join(work, RTN_OF[name], "model.safetensors"), path)
            continue
        _, layers, _ = read_quantized(os.path.join(work, name), fmt, bits, floats, n_linear, HEAD_BITS.get(name, 0))
        arrays = {}
        for base, layer in layers.items():
            bad = broken(mode, head_weight(floats) if base == "lm_head" else floats[base + ".weight"], layer)
            codes = bad.codes.astype(np.uint8)
            zeros = bad.zeros.astype(np.int64).astype(np.uint8)
            if fmt == "gptq":
                arrays[base + ".qweight"], arrays[base + ".qzeros"] = qv.gptq_pack(codes, zeros, layer.bits)
            else:
                arrays[base + ".qweight"], arrays[base + ".qzeros"] = qv.awq_pack(codes), qv.awq_pack(zeros)
            arrays[base + ".scales"] = bad.scales_f16
        rewrite_tensors(path, arrays)



# ---------------------------------------------------------------------------------------------

def perplexity(memtune, work, model_dir):
    out = run([memtune, "eval", "--model_name_or_path", model_dir, "--eval_file", os.path.join(work, "eval.jsonl"),
               "--max_length", str(EVAL_MAX_LENGTH), "--truncation_strategy", "right", "--metrics", "eval_loss,perplexity", "--json"])
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if not lines:
        raise Failure(f"memtune eval printed no JSON for {model_dir}:\n{out[-2000:]}")
    r = json.loads(lines[-1])
    # A perplexity that is not a number (null, as a non-finite value is written) is NaN here, so
    # that the comparison with its bound fails.
    ppl = r.get("perplexity")
    return float("nan") if ppl is None else float(ppl), r["eval_tokens"]


def main():
    parser = argparse.ArgumentParser(description="memtune quantize against the original float weights")
    parser.add_argument("--memtune", required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--break", dest="break_mode", choices=BREAK_MODES,
                        help="corrupt the quantized files after quantize (the run must then fail)")
    args = parser.parse_args()
    start = time.time()
    memtune = os.path.abspath(args.memtune)
    work = os.path.abspath(args.workdir)
    if os.path.isdir(work):
        shutil.rmtree(work)
    os.makedirs(work)
    failures = []

    trained = prepare(memtune, work)
    timings = {"init and train": time.time() - start}
    quantize_all(memtune, work, trained)
    timings["quantize"] = time.time() - start - sum(timings.values())
    floats = qv.read_safetensors(os.path.join(trained, "model.safetensors"))
    n_linear = linear_layers(trained)
    if args.break_mode:
        break_on_disk(args.break_mode, work, floats, n_linear)
        print(f"--break {args.break_mode}: the quantized files were corrupted; this run must fail")
    hessians, calibration_tokens = input_hessians(memtune, work, trained, "calibration", CALIBRATION_MAX_LENGTH,
                                                  CALIBRATION_TEXTS)
    held_out_hessians, held_out_tokens = input_hessians(memtune, work, trained, "eval", EVAL_MAX_LENGTH, EVAL_TEXTS)
    timings["activations"] = time.time() - start - sum(timings.values())
    print(f"model: {sum(a.size for a in floats.values())} float32 parameters after {TRAIN_STEPS} training steps; "
          f"calibration {CALIBRATION_TEXTS} texts, {calibration_tokens} tokens; held out {EVAL_TEXTS} texts, "
          f"{held_out_tokens} tokens")

    results = {}
    for name, _, bits, fmt, method, act_order in VARIANTS:
        head_bits = HEAD_BITS.get(name, 0)
        config, layers, problems = read_quantized(os.path.join(work, name), fmt, bits, floats, n_linear, head_bits)
        failures += [f"{name}: {p}" for p in problems] + check_config(name, config, fmt, bits, act_order, head_bits)
        results[name] = layers
    w_by_layer = {b: floats[b + ".weight"] for b in results["rtn4"]}
    missing = [b for b in w_by_layer if b not in hessians]
    if missing:
        raise Failure(f"no calibration activations for {missing}")

    print(f"RTN against the original weights (group {GROUP}; steps = the group's stored scale):")
    for name, _, bits, fmt, method, act_order in VARIANTS:
        for base, layer in results[name].items():
            failures += check_structure(f"{name}: {base}", layer, fmt, act_order)
        if method != "rtn":
            continue
        stats = {}
        for base, w in w_by_layer.items():
            if base in results[name]:
                failures += check_rtn(f"{name}: {base}", w, results[name][base], fmt == "gptq", stats)
        print(f"  {name:11s} {'symmetric' if fmt == 'gptq' else 'asymmetric'}: {rtn_summary(stats, bits)}")
    # The packed LM heads: symmetric RTN with their own bits, whatever method made the layers.
    head = head_weight(floats)
    for name, head_bits in HEAD_BITS.items():
        if "lm_head" not in results[name]:
            continue  # reading it failed, and said so
        stats = {}
        failures += check_rtn(f"{name}: lm_head", head, results[name]["lm_head"], True, stats)
        print(f"  {name + '.lm_head':11s} symmetric {head_bits}-bit, {head.shape[0]} x {head.shape[1]}: "
              f"{rtn_summary(stats, head_bits)}")

    print("GPTQ against RTN: layer-wise output error ||X W^T - X Wq^T||^2 on the float model's calibration inputs:")
    for name, rtn in RTN_OF.items():
        bits = VARIANT[name][2]
        stats = {}
        failures += check_gptq_vs_rtn(name, w_by_layer, results[name], results[rtn], hessians, bits, stats)
        print(f"  {name:11s} / {rtn:10s}: per layer {stats['ratio_min']:.3f}-{stats['ratio_max']:.3f} "
              f"(bound {GPTQ_VS_RTN_MAX}), all layers {stats['ratio_sum']:.3f} (bound {GPTQ_VS_RTN_SUM_MAX}); "
              f"max relative output error {stats['rel_max']:.3g} (bound {REL_OUTPUT_ERROR_MAX[bits]:g}; "
              f"RTN's {rtn_rel_output_error(w_by_layer, results[rtn], hessians):.3g})")
    print(f"... and on the {EVAL_TEXTS} held-out texts' inputs (not what GPTQ saw):")
    for name, rtn in RTN_OF.items():
        bits = VARIANT[name][2]
        stats = {}
        failures += check_gptq_vs_rtn(name, w_by_layer, results[name], results[rtn], held_out_hessians, bits, stats,
                                      GPTQ_HELD_OUT_MAX, GPTQ_HELD_OUT_SUM_MAX, "held-out output error")
        print(f"  {name:11s} / {rtn:10s}: per layer {stats['ratio_min']:.3f}-{stats['ratio_max']:.3f} "
              f"(bound {GPTQ_HELD_OUT_MAX}), all layers {stats['ratio_sum']:.3f} (bound {GPTQ_HELD_OUT_SUM_MAX}); "
              f"max relative output error {stats['rel_max']:.3g} (bound {REL_OUTPUT_ERROR_MAX[bits]:g})")

    self_fails, caught = self_check(w_by_layer, head, results, hessians)
    failures += self_fails
    print("self-check, simulated broken quantizers (failures found): " +
          ", ".join(f"{k} {v}" for k, v in caught.items()))

    timings["weight checks"] = time.time() - start - sum(timings.values())
    print(f"perplexity on {EVAL_TEXTS} held-out texts (memtune eval):")
    ppl_float, tokens = perplexity(memtune, work, trained)
    print(f"  float32    {ppl_float:.5f} ({tokens} tokens)")
    for name, _, bits, _, method, _ in VARIANTS:
        ppl, n = perplexity(memtune, work, os.path.join(work, name))
        rel = ppl / ppl_float - 1
        bound = PPL_MAX_REL[(min(bits, HEAD_BITS.get(name, bits)), method)]
        print(f"  {name:10s} {ppl:.5f} {100 * rel:+.4f}% (bound +-{100 * bound:g}%)")
        if n != tokens:
            failures.append(f"{name}: eval over {n} tokens, the float model's over {tokens}")
        if not abs(rel) <= bound:
            failures.insert(0, f"{name}: perplexity {ppl:.5f} is {100 * rel:+.3f}% from the float model's "
                            f"{ppl_float:.5f} (at most {100 * bound:g}%)")

    timings["eval"] = time.time() - start - sum(timings.values())
    print(f"{time.time() - start:.1f} s: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
    if failures:
        with open(os.path.join(work, "failures.txt"), "w") as f:
            f.write("\n".join(failures) + "\n")
        print(f"FAILED: {len(failures)} check(s), all in {os.path.join(work, 'failures.txt')}; the first of each "
              f"model's:", file=sys.stderr)
        by_model = {}
        for f in failures:
            by_model.setdefault(f.split(":")[0], []).append(f)
        for model, fs in by_model.items():
            for f in fs[:4]:
                print("  " + f, file=sys.stderr)
            if len(fs) > 4:
                print(f"  ... and {len(fs) - 4} more of {model}", file=sys.stderr)
        return 1
    print("all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print(f"FAILED: {e}", file=sys.stderr)
        sys.exit(1)
