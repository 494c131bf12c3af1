#!/usr/bin/python3
"""Checks memtune's numerics against the PyTorch reference (tools/qwen2_reference.py).

    /usr/bin/python3 tests/reference/compare_with_reference.py --memtune BIN --workdir DIR
    /usr/bin/python3 tests/reference/compare_with_reference.py --self-check --workdir DIR

For each case of CASES:
  1. `memtune init-model --preset tiny` writes a tiny Qwen2 checkpoint. Unless the case keeps
     memtune's own initialization, its weights are then replaced by random ones of the same
     names, shapes and dtype: nonzero biases, norm weights away from 1, and scales that make
     attention far from uniform, so that e.g. a dropped bias cannot hide behind a zero init.
  2. A batch of random token ids is written as JSON, with labels that are absent (default to
     input_ids), masked with -100 (scattered, a whole span, a whole row), or independent of ids.
  3. For a LoRA case, a PEFT adapter directory is written (adapter_config.json with every
     LoraConfig key, adapter_model.safetensors in F32 with random, nonzero lora_A and lora_B;
     PEFT's zero-initialized B would make A's gradient zero and hide bugs). A case with a
     dropout seed writes lora_dropout > 0 and runs `memtune dump --dropout_seed N`, which applies
     dropout as training does; the reference applies the same masks, recomputed from memtune's
     documented mask contract (qwen2_reference.lora_dropout_keep), as PEFT applies dropout: on the
     LoRA branch's input only, kept elements scaled by 1 / (1 - p). Logits, loss and every adapter
     gradient then check the masks, their scale, and that backward routes the gradient through
     the forward's masks.
  4. `memtune dump` and the reference's dump compute logits, the mean causal-LM loss and the
     gradient of every parameter; with an adapter (`--adapter DIR`), the gradient of every
     adapter tensor (`grad.<PEFT tensor name>`) and of no base parameter.
  5. Every tensor must be present in both, with equal shapes, F32, and within tolerance.

--self-check runs without memtune: each case's checkpoint is made by this script, and the
reference's float32 dump is compared against the reference computed in float64, through the
same comparison. It smoke-tests the reference and shows how much of each tolerance plain
float32 rounding uses.

Exit status 0 only if every comparison passes.

--break-dropout MODE (hidden; shows that the dropout cases can fail) makes the reference's
dropout deliberately wrong: `seed` (masks of seed ^ 1), `shift` (every mask shifted by one
element), `scale` (kept elements not scaled by 1 / (1 - p)), `off` (no dropout) or `backward`
(the forward's masks, but the gradient into x goes through masks shifted by one element); the
dropout cases must then fail.
"""

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "support"))
import qwen2_reference as ref  # noqa: E402
from numeric import difference  # noqa: E402

# Tolerances for float32 compute on both sides. Logits and loss: absolute error at most
# REL_TOL * max(1, max|ref|). Gradients: absolute error at most REL_TOL * max|ref| + GRAD_ABS_TOL,
# max|ref| taken over the whole tensor. Float32 rounding alone stays below 2e-6 relative
# (see --self-check); the bugs this test exists for (RoPE convention, bias, GQA mapping, label
# shift, ignore_index handling, tied-embedding gradient) were measured off by 5e-3 relative or
# more on these cases.
REL_TOL = 1e-4
GRAD_ABS_TOL = 1e-6

SUBPROCESS_TIMEOUT_S = 600

# What `memtune init-model --preset tiny` is taken to make (rms_norm_eps and rope_theta are
# assumed); only --self-check uses it, to build such a model itself.
TINY_PRESET = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
    "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "float32",
}


@dataclass
class Lora:
    r: int
    lora_alpha: int
    target_modules: tuple
    use_rslora: bool = False
    lora_dropout: float = 0.0  # applied only where the case has a dropout_seed

    @property
    def scaling(self):
        return self.lora_alpha / math.sqrt(self.r) if self.use_rslora else self.lora_alpha / self.r


@dataclass
class Case:
    name: str
    seed: int
    batch: int
    seq: int
    init_args: tuple = ()     # extra `memtune init-model` arguments
    labels: str = "default"   # "default": no labels key; "masked": ids with -100s;
                              # "independent": random labels with -100s
    randomize: bool = True    # replace memtune's initial weights with random ones
    dump_args: tuple = ()     # extra `memtune dump` arguments
    lora: Lora = None         # a LoRA adapter to train instead of the base parameters
    preset: str = "tiny"      # `memtune init-model --preset`: tiny (Qwen2), tiny-qwen3, tiny-llama
    dropout_seed: int = None  # LoRA dropout as in training, masks from this seed (memtune dump
                              # --dropout_seed); None: evaluation mode

    @property
    def has_targets(self):
        # Every case with T > 1 keeps targets in some row; with T = 1 nothing can be predicted.
        return self.seq > 1


UNTIED = ("--set", "tie_word_embeddings=false")
BF16 = ("--torch_dtype", "bfloat16")

CASES = [
    Case("tied_f32", seed=1, batch=2, seq=33),
    Case("tied_f32_memtune_init", seed=2, batch=2, seq=33, randomize=False),
    Case("untied_f32", seed=3, batch=3, seq=7, init_args=UNTIED),
    Case("tied_bf16", seed=4, batch=1, seq=64, init_args=BF16),
    Case("untied_bf16", seed=5, batch=2, seq=33, init_args=BF16 + UNTIED, labels="masked"),
    Case("mha_kv4", seed=6, batch=2, seq=33, init_args=("--set", "num_key_value_heads=4")),
    Case("seq1_no_targets", seed=7, batch=3, seq=1),
    Case("masked_labels", seed=8, batch=3, seq=64, labels="masked"),
    Case("untied_v1000_theta1e4", seed=9, batch=2, seq=64, labels="independent",
         init_args=UNTIED + ("--set", "vocab_size=1000", "--set", "rope_theta=10000")),
    # The same numbers must come out whatever memory strategy the plan picks.
    Case("bf16_checkpointing_chunk1", seed=10, batch=2, seq=40, init_args=BF16 + UNTIED, labels="masked",
         dump_args=("--gradient_checkpointing", "--loss_workspace_bytes", "1")),
    # LoRA: frozen base, gradients of the adapter tensors only.
    Case("lora_tied_f32_all", seed=11, batch=2, seq=33,
         lora=Lora(r=4, lora_alpha=8, target_modules=ref.LORA_TARGETS)),
    Case("lora_untied_bf16_rslora", seed=12, batch=3, seq=40, init_args=BF16 + UNTIED, labels="masked",
         lora=Lora(r=2, lora_alpha=16, target_modules=("q_proj", "v_proj", "down_proj"), use_rslora=True)),
    Case("lora_f32_checkpointing", seed=13, batch=2, seq=40, dump_args=("--gradient_checkpointing",),
         lora=Lora(r=8, lora_alpha=16, target_modules=("o_proj", "gate_proj", "up_proj"))),
    # Qwen3 (no biases, head_dim 24 != hidden / heads, q_norm and k_norm) and Llama 3 (no biases,
    # head_dim 32, untied, llama3 RoPE scaling whose three bands all hold frequencies; positions
    # up to 95 go past its original 64).
    Case("qwen3_f32", seed=14, batch=2, seq=33, preset="tiny-qwen3"),
    Case("qwen3_bf16_checkpointing", seed=15, batch=2, seq=40, preset="tiny-qwen3", init_args=BF16,
         labels="masked", dump_args=("--gradient_checkpointing",)),
    Case("qwen3_lora", seed=16, batch=2, seq=33, preset="tiny-qwen3",
         lora=Lora(r=4, lora_alpha=8, target_modules=ref.LORA_TARGETS)),
    Case("llama3_f32", seed=17, batch=2, seq=96, preset="tiny-llama"),
    Case("llama3_bf16", seed=18, batch=3, seq=40, preset="tiny-llama", init_args=BF16, labels="masked"),
    # LoRA dropout (p = 0.3) with the same masks on both sides: several rows (the mask index runs
    # over the batch's packed rows) and a seed above 2^63; gradient checkpointing (backward
    # recomputes the masks twice); and 16 tokens, where q/k/v run as one grouped product (Qwen3).
    Case("lora_dropout_f32_all", seed=19, batch=3, seq=24, labels="masked", dropout_seed=0xD1B54A32D192ED03,
         lora=Lora(r=4, lora_alpha=8, target_modules=ref.LORA_TARGETS, lora_dropout=0.3)),
    Case("lora_dropout_bf16_ckpt", seed=20, batch=2, seq=40, init_args=BF16 + UNTIED, dropout_seed=7,
         dump_args=("--gradient_checkpointing",),
         lora=Lora(r=2, lora_alpha=16, target_modules=("k_proj", "o_proj", "up_proj", "down_proj"),
                   use_rslora=True, lora_dropout=0.3)),
    Case("qwen3_lora_dropout_16tok", seed=21, batch=2, seq=8, preset="tiny-qwen3", dropout_seed=123456789,
         lora=Lora(r=4, lora_alpha=8, target_modules=ref.LORA_TARGETS, lora_dropout=0.3)),
]

SELF_CHECK_CASES = ["tied_f32", "untied_bf16", "mha_kv4", "seq1_no_targets", "masked_labels",
                    "lora_tied_f32_all", "lora_untied_bf16_rslora", "lora_dropout_f32_all"]


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

def random_weights(shapes, dtypes, seed):
    """Random tensors for {name: shape}, cast to {name: torch dtype}. Linear weights get std
    1/sqrt(fan_in) (attention scores then have std ~1), biases std 0.5, norm weights 1 +- 0.3,
    the embedding std 0.3 (tied logits ~N(0, 2.4^2))."""
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in shapes.items():
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.3 * x
        elif name.endswith(".bias"):
            x = 0.5 * x
        elif name == "model.embed_tokens.weight":
            x = 0.3 * x
        else:
            x = x / math.sqrt(shape[1])
        tensors[name] = x.to(dtypes[name])
    return tensors


def write_adapter(adapter_dir, lora, cfg, seed, base_model):
    """Writes a PEFT LoRA adapter directory for the model `cfg` as PEFT's save_pretrained does
    (adapter_config.json with every LoraConfig key, sorted; adapter_model.safetensors in F32).
    lora_A gets std 1/sqrt(in) like a linear layer, lora_B std 0.5/(scaling*sqrt(r)), so that
    scaling * B @ A has entries of std 0.5/sqrt(in), half the base weights': both factors are
    nonzero and the update is far from negligible."""
    os.makedirs(adapter_dir)
    config = {
        "alpha_pattern": {}, "auto_mapping": None, "base_model_name_or_path": base_model,
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
        "layers_pattern": None, "layers_to_transform": None, "lora_alpha": lora.lora_alpha,
        "lora_dropout": lora.lora_dropout, "modules_to_save": None, "peft_type": "LORA", "r": lora.r,
        "rank_pattern": {}, "revision": None, "target_modules": list(lora.target_modules),
        "task_type": "CAUSAL_LM", "use_rslora": lora.use_rslora, "use_dora": False,
    }
    with open(os.path.join(adapter_dir, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in ref.lora_shapes(cfg, lora.target_modules).items():
        out_features, in_features = shape
        if name.endswith(".lora_A.weight"):
            x = torch.randn(lora.r, in_features, generator=gen) / math.sqrt(in_features)
        else:
            x = torch.randn(out_features, lora.r, generator=gen) * (0.5 / (lora.scaling * math.sqrt(lora.r)))
        tensors[name] = x
    ref.write_safetensors(os.path.join(adapter_dir, "adapter_model.safetensors"), tensors, {"format": "pt"})


def write_batch(path, case, vocab_size):
    rng = np.random.default_rng(case.seed)
    ids = rng.integers(0, vocab_size, size=(case.batch, case.seq))
    doc = {"input_ids": ids.tolist()}
    if case.labels != "default":
        labels = ids.copy() if case.labels == "masked" else rng.integers(0, vocab_size, size=ids.shape)
        labels[rng.random(ids.shape) < 0.25] = ref.IGNORE_INDEX
        labels[0, case.seq // 3: case.seq // 3 + max(1, case.seq // 4)] = ref.IGNORE_INDEX
        if case.batch >= 3:
            labels[-1, :] = ref.IGNORE_INDEX
        doc["labels"] = labels.tolist()
    with open(path, "w") as f:
        json.dump(doc, f)


def tiny_config(init_args):
    """The config.json `memtune init-model --preset tiny <init_args>` is expected to write."""
    cfg = dict(TINY_PRESET)
    args = list(init_args)
    while args:
        flag, value = args.pop(0), args.pop(0)
        if flag == "--torch_dtype":
            cfg["torch_dtype"] = value
        else:
            key, _, text = value.partition("=")
            cfg[key] = json.loads(text)
    return cfg


# ---------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------

@dataclass
class Row:
    case: str
    tensor: str
    abs_err: float = float("nan")
    rel_err: float = float("nan")
    tol: float = float("nan")
    status: str = "ok"   # "ok", "skipped: why" or "FAIL: why"

    @property
    def failed(self):
        return self.status.startswith("FAIL")


def compare(case, got, want):
    """Rows comparing dump `got` (memtune's, or the float32 reference) against `want`."""
    rows = []
    for name in sorted(set(want) - set(got)):
        rows.append(Row(case.name, name, status="FAIL: missing"))
    for name in sorted(set(got) - set(want)):
        rows.append(Row(case.name, name, status="FAIL: unexpected tensor"))
    for name in want:
        if name not in got:
            continue
        row = Row(case.name, name)
        rows.append(row)
        a, r = got[name], want[name]
        if list(a.shape) != list(r.shape):
            row.status = f"FAIL: shape {list(a.shape)}, want {list(r.shape)}"
            continue
        if a.dtype != torch.float32:
            row.status = f"FAIL: dtype {a.dtype}, want F32"
            continue
        if not case.has_targets and name == "loss":
            # No position has a target: the mean over zero targets is nan in HF/PyTorch.
            if not (torch.isnan(a) and torch.isnan(r)):
                row.status = f"FAIL: want nan (no targets), got {a.item()} vs reference {r.item()}"
            continue
        if not case.has_targets and name.startswith("grad."):
            row.status = "skipped: no targets, loss is nan"
            continue
        # A NaN or an infinity on either side fails (difference names the first one).
        d = difference(a, r)
        if d.problem:
            row.status = f"FAIL: {d.problem}"
            continue
        scale = d.scale
        row.abs_err = d.worst
        row.rel_err = row.abs_err / scale if scale > 0 else 0.0
        if name.startswith("grad."):
            row.tol = REL_TOL * scale + GRAD_ABS_TOL
        else:
            row.tol = REL_TOL * max(1.0, scale)
        if not row.abs_err <= row.tol:
            row.status = (f"FAIL: over tolerance at index {d.index}: memtune {d.got:.9g}, reference {d.want:.9g}, "
                          f"|diff| {d.worst:.6g} > tolerance {row.tol:.6g}")
    return rows


def print_rows(rows):
    def num(x):
        return f"{'-':>10}" if math.isnan(x) else f"{x:>10.3e}"

    for row in rows:
        print(f"{row.case:<24} {row.tensor:<68} {num(row.abs_err)} {num(row.rel_err)} "
              f"{num(row.tol)}  {row.status}")
    sys.stdout.flush()


# ---------------------------------------------------------------------------------------------
# running a case
# ---------------------------------------------------------------------------------------------

class CaseError(Exception):
    pass


def run(cmd):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise CaseError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{tail}")


def randomize_checkpoint(model_dir, seed):
    """Rewrites model_dir/model.safetensors with random values, keeping names, shapes, dtypes."""
    path = os.path.join(model_dir, "model.safetensors")
    stored = ref.read_safetensors(path)
    shapes = {name: list(t.shape) for name, t in stored.items()}
    dtypes = {name: t.dtype for name, t in stored.items()}
    ref.write_safetensors(path, random_weights(shapes, dtypes, seed), {"format": "pt"})


def check_memtune_checkpoint(model_dir, case):
    """memtune's checkpoint must store every tensor in the requested dtype."""
    want = torch.bfloat16 if "bfloat16" in case.init_args else torch.float32
    stored = ref.read_checkpoint(model_dir)
    wrong = sorted(name for name, t in stored.items() if t.dtype != want)
    if wrong:
        raise CaseError(f"init-model stored {len(wrong)} tensors not as {want}, e.g. {wrong[0]}")


def break_dropout(mode):
    """--break-dropout: makes the reference's LoRA dropout wrong in one way (see the docstring)."""
    keep, dropout, key = ref.lora_dropout_keep, ref.lora_dropout, ref.lora_dropout_key
    if mode == "seed":
        ref.lora_dropout_key = lambda seed, layer, site: key(seed ^ 1, layer, site)
    elif mode == "shift":
        ref.lora_dropout_keep = lambda k, numel, p: np.roll(keep(k, numel, p), 1)
    elif mode == "scale":
        ref.lora_dropout = lambda x, lora, layer, site: dropout(x, lora, layer, site) * (1.0 - lora.dropout)
    elif mode == "off":
        ref.lora_dropout = lambda x, lora, layer, site: x
    elif mode == "backward":
        class WrongBackward(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x, fwd_mask, bwd_mask):
                ctx.save_for_backward(bwd_mask)
                return x * fwd_mask

            @staticmethod
            def backward(ctx, grad):
                (bwd_mask,) = ctx.saved_tensors
                return grad * bwd_mask, None, None

        def wrong_backward(x, lora, layer, site):
            mask = keep(key(lora.dropout_seed, layer, site), x.numel(), lora.dropout)
            fwd, bwd = (torch.from_numpy(m).view(x.shape).to(x.dtype) / (1.0 - lora.dropout)
                        for m in (mask, np.roll(mask, 1)))
            return WrongBackward.apply(x, fwd, bwd)

        ref.lora_dropout = wrong_backward


def dropout_args(case):
    return [] if case.dropout_seed is None else ["--dropout_seed", str(case.dropout_seed)]


def run_case_memtune(case, memtune, case_dir):
    model_dir = os.path.join(case_dir, "model")
    run([memtune, "init-model", "--preset", case.preset, "--out", model_dir, "--seed", str(case.seed),
         *case.init_args])
    check_memtune_checkpoint(model_dir, case)
    if case.randomize:
        randomize_checkpoint(model_dir, 1000 + case.seed)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = ref.Qwen2Config.from_json(json.load(f))
    input_path = os.path.join(case_dir, "input.json")
    write_batch(input_path, case, cfg.vocab_size)
    adapter_dir, adapter_args = None, []
    if case.lora is not None:
        adapter_dir = os.path.join(case_dir, "adapter")
        write_adapter(adapter_dir, case.lora, cfg, 2000 + case.seed, model_dir)
        adapter_args = ["--adapter", adapter_dir]

    memtune_out = os.path.join(case_dir, "memtune.safetensors")
    run([memtune, "dump", "--model", model_dir, "--input", input_path, "--out", memtune_out,
         *adapter_args, *dropout_args(case), *case.dump_args])
    ref_out = os.path.join(case_dir, "reference.safetensors")
    ref.dump(model_dir, input_path, ref_out, adapter_dir=adapter_dir, dropout_seed=case.dropout_seed)
    return compare(case, ref.read_safetensors(memtune_out), ref.read_safetensors(ref_out))


def run_case_self_check(case, case_dir):
    model_dir = os.path.join(case_dir, "model")
    os.makedirs(model_dir)
    config = tiny_config(case.init_args)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    cfg = ref.Qwen2Config.from_json(config)
    shapes = ref.parameter_shapes(cfg)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config["torch_dtype"]]
    weights = random_weights(shapes, dict.fromkeys(shapes, dtype), 1000 + case.seed)
    ref.write_safetensors(os.path.join(model_dir, "model.safetensors"), weights, {"format": "pt"})
    input_path = os.path.join(case_dir, "input.json")
    write_batch(input_path, case, cfg.vocab_size)
    adapter_dir = None
    if case.lora is not None:
        adapter_dir = os.path.join(case_dir, "adapter")
        write_adapter(adapter_dir, case.lora, cfg, 2000 + case.seed, model_dir)

    f32_out = os.path.join(case_dir, "reference.safetensors")
    ref.dump(model_dir, input_path, f32_out, adapter_dir=adapter_dir, dropout_seed=case.dropout_seed)
    f64_out = os.path.join(case_dir, "reference_f64.safetensors")
    ref.dump(model_dir, input_path, f64_out, dtype=torch.float64, adapter_dir=adapter_dir,
             dropout_seed=case.dropout_seed)
    return compare(case, ref.read_safetensors(f32_out), ref.read_safetensors(f64_out))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--memtune", help="path to the memtune binary")
    parser.add_argument("--workdir", help="scratch directory (default: a temporary one)")
    parser.add_argument("--self-check", action="store_true",
                        help="skip memtune: compare the float32 reference against float64")
    parser.add_argument("--break-dropout", choices=("seed", "shift", "scale", "off", "backward"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--cases", nargs="+", help=argparse.SUPPRESS)  # run only these (debugging)
    args = parser.parse_args()
    if not args.self_check and not args.memtune:
        parser.error("--memtune is required unless --self-check is given")
    if not args.self_check and not os.access(args.memtune, os.X_OK):
        parser.error(f"--memtune {args.memtune}: not an executable file")
    workdir = args.workdir or tempfile.mkdtemp(prefix="memtune_reference_")
    os.makedirs(workdir, exist_ok=True)
    cases = [c for c in CASES if c.name in SELF_CHECK_CASES] if args.self_check else CASES
    if args.cases:
        unknown = sorted(set(args.cases) - {c.name for c in CASES})
        if unknown:
            parser.error(f"--cases: unknown {unknown}")
        cases = [c for c in cases if c.name in args.cases]
    if args.break_dropout:
        break_dropout(args.break_dropout)
        print(f"--break-dropout {args.break_dropout}: the reference's LoRA dropout is wrong on purpose; "
              f"the dropout cases must FAIL")
    against = "float32 reference vs float64 reference" if args.self_check else "memtune vs reference"

    print(f"{against}; tolerances: logits/loss abs <= {REL_TOL:g}*max(1,max|ref|), "
          f"grads abs <= {REL_TOL:g}*max|ref| + {GRAD_ABS_TOL:g}; workdir {workdir}")
    print(f"{'case':<24} {'tensor':<68} {'max_abs':>10} {'max_rel':>10} {'tol':>10}  status")
    all_rows = []
    failed_cases = []
    for case in cases:
        case_dir = os.path.join(workdir, case.name)
        shutil.rmtree(case_dir, ignore_errors=True)
        os.makedirs(case_dir)
        try:
            if args.self_check:
                rows = run_case_self_check(case, case_dir)
            else:
                rows = run_case_memtune(case, args.memtune, case_dir)
        except (CaseError, ValueError, KeyError, OSError, subprocess.TimeoutExpired) as e:
            rows = [Row(case.name, "(case)", status=f"FAIL: {e}")]
        print_rows(rows)
        all_rows += rows
        if any(row.failed for row in rows):
            failed_cases.append(case.name)

    compared = sum(1 for row in all_rows if row.status == "ok")
    skipped = sum(1 for row in all_rows if row.status.startswith("skipped"))
    failures = sum(1 for row in all_rows if row.failed)
    verdict = "PASS" if not failures else f"FAIL (cases: {', '.join(failed_cases)})"
    print(f"SUMMARY: {against}: {len(cases)} cases, {compared} tensors within tolerance, "
          f"{skipped} skipped (no-target case gradients), {failures} failures -> {verdict}")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
