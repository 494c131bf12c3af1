#!/usr/bin/python3
"""Checks memtune's optimizer step (loss normalization, gradient clipping, AdamW, learning-rate
schedule, which tensors take weight decay) against PyTorch's own torch.nn.utils.clip_grad_norm_,
torch.optim.AdamW and torch.optim.lr_scheduler.LambdaLR, step by step.

    /usr/bin/python3 tests/reference/optimizer_vs_torch.py --memtune BIN --workdir DIR
    /usr/bin/python3 tests/reference/optimizer_vs_torch.py --memtune BIN --workdir DIR --break l2

For each case of CASES (full fine-tuning of an untied model, LoRA on a tied one):
  1. `memtune init-model --preset tiny` writes the model; its weights are replaced by random ones
     (compare_with_reference.randomize_checkpoint: nonzero biases, norm weights away from 1, so a
     wrong weight-decay group changes them visibly). A byte-level tokenizer written here (token id
     = byte value, <|endoftext|> = 256 as eos, no merges) goes beside it, so the ids of a text are
     its UTF-8 bytes plus eos; `memtune tokenize` is asked to confirm that.
  2. The training set is four (or six) `{"text": ...}` lines of different lengths and one
     optimizer step takes all of them: one micro-batch, or gradient_accumulation_steps
     micro-batches that split them evenly, so every step sees the same examples whatever
     memtune's shuffle does.
  3. `memtune train` runs the case's steps with --save_steps 1 --logging_steps 1 into a fresh
     output_dir: clipping active on some steps and not on others, warmup then cosine decay,
     weight decay, non-default betas and eps (one case leaves --adam_epsilon out: memtune's
     default must be Hugging Face TrainingArguments' 1e-8, which the reference then uses).
  4. PyTorch repeats them in float64 with tools/qwen2_reference.py's model: the batch
     right-padded with labels -100 and hf_causal_lm_loss (the summed token losses of the step
     divided by its target tokens; with gradient accumulation, as the Trainer does with
     num_items_in_batch: each micro-batch's summed loss divided by the target tokens of the whole
     step, backward per micro-batch, the gradients accumulated), clip_grad_norm_(max_norm), AdamW over two
     parameter groups (weight decay, and none for the names Hugging Face Trainer excludes: bias,
     layernorm, rmsnorm, norm, _norm), LambdaLR with get_cosine_schedule_with_warmup's formula
     written out. In float64 the oracle is exact at float32's scale, so what differs is
     memtune's float32 rounding.
  5. After every step k: the loss, grad_norm (before clipping) and learning_rate memtune logged,
     and every trainable tensor of checkpoint-k and its AdamW moments (optimizer.safetensors
     exp_avg. / exp_avg_sq.) against PyTorch's parameters and optimizer state.

LoRA starts from memtune's own PEFT initialization (B = 0, A random), which this script cannot
know in advance: it is read from checkpoint-1. That is exact because the warmup's first step has
learning rate 0 (Hugging Face's formula), so step 1 changes only the moments (checked); B must
still be exactly zero there.

--break VARIANT makes the PyTorch side deliberately wrong in one way, to show the comparison
catches it (the run must then FAIL): clip_norm (clip at half the max norm), no_clip, l2 (Adam
with L2 regularization instead of decoupled weight decay), decay_all (weight decay on biases and
norm weights too), schedule_shift (the schedule one step ahead), accumulation_mean (each
micro-batch's loss divided by its own target tokens and the sum divided by the number of
micro-batches, the normalization that gradient accumulation gets wrong; it changes only the
accumulation cases), default_eps (epsilon 1e-6 where the case leaves memtune's default; it
changes only that case).

Exit status 0 only if every comparison passes.
"""

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "support"))
import qwen2_reference as ref  # noqa: E402
from compare_with_reference import randomize_checkpoint  # noqa: E402
from byte_tokenizer import EOS_ID, write_tokenizer  # noqa: E402
from numeric import difference  # noqa: E402

SUBPROCESS_TIMEOUT_S = 120

# memtune computes in float32, the reference in float64 (the same torch.optim code). Tolerances,
# per tensor, with `scale` = max |reference tensor|:
#  - loss: abs error <= LOSS_REL_TOL * max(1, |loss|); grad_norm: relative error <= NORM_REL_TOL
#    (measured: 1e-7 and 7e-7; compare_with_reference.py finds gradients within 2.5e-6 of their
#    scale).
#  - learning rate: relative error <= LR_REL_TOL (the same double formula on both sides).
#  - parameters: abs error <= PARAM_REL_TOL * scale + case.param_lr_tol * peak learning rate.
#    The first term is float32 rounding of values of size `scale` over a few steps. The second
#    is Adam's own amplification: its step lr * m / (sqrt(v) + eps) turns an error d in a
#    gradient element into a step error of up to about lr * d / eps where |g| is near eps or
#    below. The gradients agree to ~1e-9 absolute (1e-6 of their scale, as PyTorch's own float32
#    gradients do), so the cases use adam_epsilon 1e-4, where that term is ~1e-7 and the check
#    can be sharp. (With Hugging Face's default 1e-8, measured on a tied variant of the full
#    case: the few elements whose gradient is below 1e-8, in a RoPE'd k_proj bias, end up 9% of
#    a peak step from float64, PyTorch's own float32 run 1.5%, with gradients as accurate as
#    PyTorch's float32 ones, 9e-7 of their scale. A tolerance that admits this admits bugs.)
#    Measured with eps 1e-4: full 4.8e-7 (0.31 of its tolerance); LoRA 2.4e-6 (0.38), in lora_A
#    right after B leaves zero, where A's gradient is small, hence its larger param_lr_tol
#    (PyTorch's float32 run differs from float64 by 2.7e-6 there). The case with the default
#    eps 1e-8 is a LoRA one (see CASES).
#  - moments (exp_avg, exp_avg_sq): abs error <= MOMENT_REL_TOL * scale, or exactly equal when the
#    reference is all zero (LoRA's A until B leaves zero). Measured: below 0.07 of the tolerance.
# Each broken variant (--break) misses the parameters by 200x or more and the moments by 20x or
# more, in at least one case (decay_all changes nothing in LoRA, which trains no bias or norm).
# Every comparison fails on a NaN or an infinity on either side (tests/support/numeric.py).
REFERENCE_DTYPE = torch.float64
LOSS_REL_TOL = 1e-5
NORM_REL_TOL = 1e-5
LR_REL_TOL = 1e-9
PARAM_REL_TOL = 2e-6
MOMENT_REL_TOL = 1e-4

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "pack my box with five dozen liquor jugs!",
    "sphinx of black quartz, judge my vow",
    "how vexingly quick daft zebras jump; 0123",
    "waltz, bad nymph, for quick jigs vex",
    "the five boxing wizards jump quickly at dawn, said 42 of them",
]

BREAKS = ("clip_norm", "no_clip", "l2", "decay_all", "schedule_shift", "accumulation_mean", "default_eps")
# Hugging Face TrainingArguments' adam_epsilon (torch.optim.AdamW's eps default too): what the
# reference uses where a case leaves --adam_epsilon to memtune's default.
HF_DEFAULT_ADAM_EPSILON = 1e-8


@dataclass
class Case:
    name: str
    seed: int
    tuner: str                # "full" or "lora"
    init_args: tuple = ()     # extra `memtune init-model` arguments
    steps: int = 6
    warmup_steps: int = 2
    learning_rate: float = 1e-2
    weight_decay: float = 0.1
    adam_beta1: float = 0.85
    adam_beta2: float = 0.98
    adam_epsilon: float = 1e-4  # None: --adam_epsilon not passed (memtune's default)
    # The parameters' tolerance beyond rounding, as a fraction of the peak learning rate.
    param_lr_tol: float = 1e-4
    max_grad_norm: float = 1.0
    lora_rank: int = 4
    lora_alpha: float = 8.0
    texts: int = 4                  # the first `texts` of TEXTS: one optimizer step takes them all
    gradient_accumulation_steps: int = 1

    @property
    def sequences(self):
        return expected_sequences()[:self.texts]

    @property
    def micro_batch(self):
        return self.texts // self.gradient_accumulation_steps

    def reference_epsilon(self, broken=None):
        if self.adam_epsilon is not None:
            return self.adam_epsilon
        return 1e-6 if broken == "default_eps" else HF_DEFAULT_ADAM_EPSILON

    def train_args(self):
        if self.micro_batch * self.gradient_accumulation_steps != self.texts:
            raise ValueError(f"{self.name}: {self.texts} texts do not split into "
                             f"{self.gradient_accumulation_steps} equal micro-batches")
        args = ["--tuner_type", self.tuner, "--max_steps", str(self.steps),
                "--per_device_train_batch_size", str(self.micro_batch),
                "--gradient_accumulation_steps", str(self.gradient_accumulation_steps),
                "--learning_rate", repr(self.learning_rate), "--weight_decay", repr(self.weight_decay),
                "--adam_beta1", repr(self.adam_beta1), "--adam_beta2", repr(self.adam_beta2),
                "--max_grad_norm", repr(self.max_grad_norm),
                "--lr_scheduler_type", "cosine", "--warmup_steps", str(self.warmup_steps),
                "--save_steps", "1", "--logging_steps", "1", "--seed", str(self.seed)]
        if self.adam_epsilon is not None:
            args += ["--adam_epsilon", repr(self.adam_epsilon)]
        if self.tuner == "lora":
            args += ["--lora_rank", str(self.lora_rank), "--lora_alpha", repr(self.lora_alpha),
                     "--lora_dropout", "0", "--target_modules", "all-linear"]
        return args


# max_grad_norm lies between the gradient norms of the steps (the script checks that some steps
# are clipped and some are not, so the clip factor differs between steps and reaches the weights).
CASES = [
    Case("full_untied", seed=3, tuner="full", init_args=("--set", "tie_word_embeddings=false"),
         max_grad_norm=2.3),
    Case("lora_tied", seed=4, tuner="lora", learning_rate=2e-2, max_grad_norm=3.0, param_lr_tol=3e-4),
    # Gradient accumulation: the step's loss is its summed token losses over its target tokens, the
    # micro-batches' counts added before the one division (2 micro-batches of 2 texts; 3 of 2).
    Case("full_untied_accum2", seed=5, tuner="full", init_args=("--set", "tie_word_embeddings=false"),
         gradient_accumulation_steps=2, max_grad_norm=2.3),
    Case("lora_tied_accum3", seed=6, tuner="lora", texts=6, gradient_accumulation_steps=3, learning_rate=2e-2,
         max_grad_norm=3.0, param_lr_tol=3e-4),
    # memtune's default adam_epsilon (no --adam_epsilon) against Hugging Face's 1e-8. LoRA: full
    # fine-tuning has gradient elements near or below 1e-8 (see above; measured 64x its tolerance).
    # LoRA's are larger, but lora_A's right after B leaves zero are small enough for eps 1e-8 to
    # amplify float32 rounding: measured 0.12 of the tolerance with seed 9 (0.44 with seed 4, 0.83
    # with seed 7). Epsilon 1e-6 instead (--break default_eps) misses by far more.
    Case("lora_tied_default_eps", seed=9, tuner="lora", adam_epsilon=None, learning_rate=2e-2, max_grad_norm=3.0,
         param_lr_tol=3e-4),
]


class Mismatch(Exception):
    pass


def run(cmd, stdin=None):
    proc = subprocess.run([str(c) for c in cmd], input=stdin, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise Mismatch(f"`{' '.join(map(str, cmd))}` exited with {proc.returncode}:\n{tail}")
    return proc.stdout


# ---------------------------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------------------------

def expected_sequences():
    """The examples memtune's text format makes: the text's ids, then eos; labels = ids."""
    return [list(text.encode()) + [EOS_ID] for text in TEXTS]


def check_tokenization(memtune, model_dir):
    out = run([memtune, "tokenize", "--tokenizer", model_dir],
              stdin="".join(json.dumps(t) + "\n" for t in TEXTS))
    got = [json.loads(line) for line in out.splitlines() if line.strip()]
    want = [list(t.encode()) for t in TEXTS]
    if got != want:
        raise Mismatch(f"memtune tokenize gives {got}, expected the UTF-8 bytes {want}")


def padded_batch(sequences):
    """[B, T] input_ids right-padded with eos, labels -100 at the padding. Attention is causal,
    so padding at the end changes nothing at the real positions."""
    longest = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), longest), EOS_ID, dtype=torch.int64)
    labels = torch.full((len(sequences), longest), ref.IGNORE_INDEX, dtype=torch.int64)
    for i, s in enumerate(sequences):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, :len(s)] = torch.tensor(s)
    return ids, labels


# ---------------------------------------------------------------------------------------------
# the PyTorch side
# ---------------------------------------------------------------------------------------------

# Hugging Face Trainer.get_decay_parameter_names: parameters of nn.LayerNorm modules (none here)
# and parameters whose lowercased name matches one of these get no weight decay.
NO_DECAY_PATTERNS = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)",
                                             r"_norm(?:$|\.)")]


def takes_weight_decay(name):
    return not any(p.search(name.lower()) for p in NO_DECAY_PATTERNS)


def cosine_with_warmup(warmup, total):
    """transformers.get_cosine_schedule_with_warmup's lambda (num_cycles 0.5)."""
    def multiplier(step):
        if step < warmup:
            return float(step) / float(max(1, warmup))
        progress = float(step - warmup) / float(max(1, total - warmup))
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * 0.5 * 2.0 * progress)))
    return multiplier


def torch_steps(case, cfg, params, lora, trainable, sequences, broken):
    """Yields (step, lr, loss, grad_norm, {name: param}, {name: exp_avg}, {name: exp_avg_sq})
    after each of the case's optimizer steps, computed the Hugging Face Trainer way."""
    names = list(trainable)
    decay = [n for n in names if broken == "decay_all" or takes_weight_decay(n)]
    no_decay = [n for n in names if n not in decay]
    groups = [{"params": [trainable[n] for n in decay], "weight_decay": case.weight_decay},
              {"params": [trainable[n] for n in no_decay], "weight_decay": 0.0}]
    opt_cls = torch.optim.Adam if broken == "l2" else torch.optim.AdamW
    optimizer = opt_cls(groups, lr=case.learning_rate, betas=(case.adam_beta1, case.adam_beta2),
                        eps=case.reference_epsilon(broken))
    multiplier = cosine_with_warmup(case.warmup_steps, case.steps)

    def schedule(step):
        return multiplier(step + 1 if broken == "schedule_shift" else step)

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    max_norm = case.max_grad_norm * (0.5 if broken == "clip_norm" else 1.0)
    # The step's micro-batches (in the dataset's order; memtune's shuffle may group them otherwise,
    # which changes nothing but float64 rounding: every micro-batch divides by the step's count).
    ga = case.gradient_accumulation_steps
    size = len(sequences) // ga
    micro_batches = [padded_batch(sequences[k * size:(k + 1) * size]) for k in range(ga)]
    step_items = sum(len(s) - 1 for s in sequences)  # targets: every token but each sequence's first
    for step in range(1, case.steps + 1):
        lr = optimizer.param_groups[0]["lr"]
        optimizer.zero_grad(set_to_none=True)
        loss = 0.0
        for input_ids, labels in micro_batches:
            logits = ref.forward(cfg, params, input_ids, lora)
            # hf_causal_lm_loss divides by the micro-batch's own targets; the Trainer's
            # num_items_in_batch makes it the step's (accumulation_mean: the per-micro-batch mean,
            # averaged over the micro-batches).
            items = sum(int((lab != ref.IGNORE_INDEX).sum()) - 1 for lab in labels)
            part = ref.hf_causal_lm_loss(logits, labels)
            part = part / ga if broken == "accumulation_mean" else part * (items / step_items)
            part.backward()
            loss = loss + part.detach()
        # Autograd leaves a zero tensor (not None) where the gradient is zero (LoRA's A while B
        # is 0), so AdamW counts the step for every tensor, as memtune does.
        missing = [n for n in names if trainable[n].grad is None]
        if missing:
            raise Mismatch(f"reference: no gradient for {missing[:3]}")
        if broken == "no_clip":
            grad_norm = torch.norm(torch.stack([trainable[n].grad.norm() for n in names]))
        else:
            grad_norm = torch.nn.utils.clip_grad_norm_([trainable[n] for n in names], max_norm)
        optimizer.step()
        scheduler.step()
        state = optimizer.state
        yield (step, lr, loss.item(), grad_norm.item(),
               {n: trainable[n].detach().clone() for n in names},
               {n: state[trainable[n]]["exp_avg"].clone() for n in names},
               {n: state[trainable[n]]["exp_avg_sq"].clone() for n in names})


# ---------------------------------------------------------------------------------------------
# comparison
# ---------------------------------------------------------------------------------------------

def scalar_problem(what, got, want, tol):
    """None if |got - want| <= tol with both finite, else the failure (NaN and infinities fail)."""
    d = difference(got, want)
    if d.problem or not d.worst <= tol:
        return f"{what} {got!r}, torch {want!r}: {d.problem or f'|diff| {d.worst:.3e}'} (tolerance {tol:.3e})"
    return None


def worst(got, want, tol_of):
    """Compares memtune's {name: tensor} with the reference's; returns (largest abs err / tol, the
    tensor it is in, its abs err, failure messages). A NaN or an infinity on either side fails."""
    failures, worst_ratio, worst_name, worst_abs = [], 0.0, "-", 0.0
    for name, r in want.items():
        if name not in got:
            failures.append(f"{name}: missing in memtune's checkpoint")
            continue
        a = got[name]
        if list(a.shape) != list(r.shape):
            failures.append(f"{name}: shape {list(a.shape)}, want {list(r.shape)}")
            continue
        d = difference(a, r)
        if d.problem:
            failures.append(f"{name}: {d.problem} (memtune's checkpoint, the reference)")
            continue
        abs_err = d.worst
        tol = tol_of(r)
        ratio = abs_err / tol if tol > 0 else (0.0 if abs_err == 0 else math.inf)
        if ratio > worst_ratio:
            worst_ratio, worst_name, worst_abs = ratio, name, abs_err
        if not abs_err <= tol:
            failures.append(f"{name}: max abs err {abs_err:.3e} > tol {tol:.3e} at index {d.index} (memtune "
                            f"{d.got:.9g}, torch {d.want:.9g}; max|ref| {d.scale:.3e})")
    for name in sorted(set(got) - set(want)):
        failures.append(f"{name}: in memtune's checkpoint, not trainable in the reference")
    return worst_ratio, worst_name, worst_abs, failures


def read_log(path):
    records = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                doc = json.loads(line)
                if "loss" in doc and "step" in doc:
                    records[doc["step"]] = doc
    return records


def run_case(case, memtune, workdir, broken):
    case_dir = os.path.join(workdir, case.name)
    shutil.rmtree(case_dir, ignore_errors=True)
    os.makedirs(case_dir)
    model_dir = os.path.join(case_dir, "model")
    run([memtune, "init-model", "--preset", "tiny", "--out", model_dir, "--seed", str(case.seed), *case.init_args])
    randomize_checkpoint(model_dir, 1000 + case.seed)
    write_tokenizer(model_dir)
    check_tokenization(memtune, model_dir)
    train_file = os.path.join(case_dir, "train.jsonl")
    with open(train_file, "w") as f:
        for text in TEXTS[:case.texts]:
            f.write(json.dumps({"text": text}) + "\n")
    out_dir = os.path.join(case_dir, "run")  # fresh: memtune refuses a non-empty output_dir
    run([memtune, "train", "--model_name_or_path", model_dir, "--train_file", train_file, "--output_dir", out_dir,
         *case.train_args()])

    cfg, params = ref.load_model(model_dir, REFERENCE_DTYPE)
    lora = None
    if case.tuner == "full":
        trainable = params

        def checkpoint(k):
            return ref.read_checkpoint(os.path.join(out_dir, f"checkpoint-{k}"))
    else:
        for p in params.values():
            p.requires_grad_(False)
        first = os.path.join(out_dir, "checkpoint-1")
        lora = ref.load_adapter(first, cfg, REFERENCE_DTYPE)
        if (lora.r, lora.lora_alpha, lora.target_modules) != (case.lora_rank, case.lora_alpha, ref.LORA_TARGETS):
            raise Mismatch(f"checkpoint-1/adapter_config.json: r {lora.r}, alpha {lora.lora_alpha}, targets "
                           f"{lora.target_modules}; expected {case.lora_rank}, {case.lora_alpha}, all seven")
        nonzero_b = [n for n, t in lora.weights.items() if n.endswith("lora_B.weight") and t.abs().max() != 0]
        if nonzero_b:
            raise Mismatch(f"checkpoint-1: lora_B must still be 0 after a step with learning rate 0, "
                           f"{nonzero_b[0]} is not")
        trainable = lora.weights

        def checkpoint(k):
            return ref.read_safetensors(os.path.join(out_dir, f"checkpoint-{k}", "adapter_model.safetensors"))
    initial = {n: t.detach().clone() for n, t in trainable.items()}
    log = read_log(os.path.join(out_dir, "log.jsonl"))
    total_tokens = sum(len(s) for s in case.sequences)

    peak_lr = case.learning_rate

    def p_tol(r):
        return PARAM_REL_TOL * r.abs().max().item() + case.param_lr_tol * peak_lr

    def m_tol(r):
        return MOMENT_REL_TOL * r.abs().max().item()

    print(f"{case.name}: {case.tuner}, {sum(t.numel() for t in trainable.values())} trainable values in "
          f"{len(trainable)} tensors, {sum(takes_weight_decay(n) for n in trainable)} of them with weight decay; "
          f"max_grad_norm {case.max_grad_norm:g}, lr {peak_lr:g}, weight_decay {case.weight_decay:g}, "
          f"betas ({case.adam_beta1:g}, {case.adam_beta2:g}), eps {case.reference_epsilon(broken):g}"
          f"{'' if case.adam_epsilon is not None else ' (memtune: its default)'}, {case.texts} texts in "
          f"{case.gradient_accumulation_steps} micro-batch(es) of {case.micro_batch} per step, "
          f"warmup {case.warmup_steps} + cosine over {case.steps} steps; parameter tolerance "
          f"{PARAM_REL_TOL:g}*max|p| + {case.param_lr_tol:g}*lr")
    print(f"  {'step':>4} {'lr':>9} {'loss memtune':>13} {'loss torch':>12} {'norm memtune':>13} {'norm torch':>11} "
          f"{'clip':>5}  {'param max abs':>13} {'/tol':>6} {'exp_avg /tol':>12} {'exp_avg_sq /tol':>15}")
    failures, clipped, worst_param_abs, worst_ratio = [], [], 0.0, 0.0
    final = None
    for step, lr, loss, grad_norm, p_ref, m_ref, v_ref in torch_steps(
            case, cfg, params, lora, trainable, case.sequences, broken):
        rec = log.get(step)
        if rec is None:
            raise Mismatch(f"log.jsonl has no record of step {step}")
        problems = [p for p in (scalar_problem("loss", rec["loss"], loss, LOSS_REL_TOL * max(1.0, abs(loss))),
                                scalar_problem("grad_norm", rec["grad_norm"], grad_norm, NORM_REL_TOL * abs(grad_norm)),
                                scalar_problem("learning_rate", rec["learning_rate"], lr, LR_REL_TOL * peak_lr))
                    if p]
        if rec.get("num_input_tokens_seen") != step * total_tokens:
            problems.append(f"num_input_tokens_seen {rec.get('num_input_tokens_seen')}, expected "
                            f"{step * total_tokens} (every step is the whole set of {case.texts} examples)")
        clipped.append(grad_norm > case.max_grad_norm)

        got = checkpoint(step)
        opt = ref.read_safetensors(os.path.join(out_dir, f"checkpoint-{step}", "optimizer.safetensors"))
        p_ratio, p_name, p_abs, p_fail = worst(got, p_ref, p_tol)
        m_ratio, _, _, m_fail = worst({n[len("exp_avg."):]: t for n, t in opt.items() if n.startswith("exp_avg.")},
                                           m_ref, m_tol)
        v_ratio, _, _, v_fail = worst({n[len("exp_avg_sq."):]: t for n, t in opt.items()
                                            if n.startswith("exp_avg_sq.")}, v_ref, m_tol)
        problems += [f"param {x}" for x in p_fail] + [f"exp_avg {x}" for x in m_fail] + \
                    [f"exp_avg_sq {x}" for x in v_fail]
        worst_param_abs = max(worst_param_abs, p_abs)
        worst_ratio = max(worst_ratio, p_ratio, m_ratio, v_ratio)
        print(f"  {step:>4} {lr:>9.3e} {rec['loss']:>13.7f} {loss:>12.7f} {rec['grad_norm']:>13.7f} {grad_norm:>11.7f} "
              f"{'yes' if clipped[-1] else 'no':>5}  {p_abs:>13.3e} {p_ratio:>6.3f} {m_ratio:>12.3f} {v_ratio:>15.3f}"
              f"   (worst: {p_name})")
        for p in problems[:8]:
            print(f"       FAIL step {step}: {p}")
        if len(problems) > 8:
            print(f"       ... and {len(problems) - 8} more")
        failures += [f"step {step}: {p}" for p in problems]
        final = p_ref
    sys.stdout.flush()

    # The test must exercise what it claims: both clipped and unclipped steps, and weights that
    # moved far more than the tolerance.
    if broken is None and (all(clipped) or not any(clipped)):
        failures.append(f"max_grad_norm {case.max_grad_norm} clips {'every' if all(clipped) else 'no'} step: "
                        f"choose one between the steps' gradient norms")
    unmoved = [n for n, t in final.items() if not difference(t, initial[n]).worst >= 10 * p_tol(t)]
    if unmoved:
        failures.append(f"{len(unmoved)} tensors moved by less than 10x their tolerance over the run "
                        f"(e.g. {unmoved[0]}): the comparison would not see a wrong update")
    return failures, worst_param_abs, worst_ratio


def main():
    parser = argparse.ArgumentParser(description="memtune's gradient clipping, AdamW and learning-rate "
                                     "schedule against PyTorch's, parameter by parameter after every step")
    parser.add_argument("--memtune", required=True, help="path to the memtune binary")
    parser.add_argument("--workdir", required=True, help="scratch directory (its case folders are replaced)")
    parser.add_argument("--break", dest="broken", choices=BREAKS,
                        help="make the PyTorch side wrong on purpose; the run must then fail")
    args = parser.parse_args()
    if not os.access(args.memtune, os.X_OK):
        parser.error(f"--memtune {args.memtune}: not an executable file")
    os.makedirs(args.workdir, exist_ok=True)
    torch.manual_seed(0)
    start = time.monotonic()
    print(f"memtune's optimizer vs torch.optim.AdamW + clip_grad_norm_ + LambdaLR"
          f"{f' (reference deliberately broken: {args.broken})' if args.broken else ''}; tolerances: loss "
          f"{LOSS_REL_TOL:g} rel, grad_norm {NORM_REL_TOL:g} rel, learning rate {LR_REL_TOL:g} rel, moments "
          f"{MOMENT_REL_TOL:g}*max|m|, parameters per case; workdir {args.workdir}")
    failed = []
    overall_abs, overall_ratio = 0.0, 0.0
    for case in CASES:
        try:
            failures, worst_abs, ratio = run_case(case, args.memtune, args.workdir, args.broken)
        except (Mismatch, ValueError, KeyError, OSError, subprocess.TimeoutExpired) as e:
            failures, worst_abs, ratio = [f"{e}"], float("nan"), float("nan")
        overall_abs, overall_ratio = max(overall_abs, worst_abs), max(overall_ratio, ratio)
        if failures:
            failed.append(case.name)
            print(f"{case.name}: FAIL ({len(failures)} problems)")
            for f in failures[:20]:
                print(f"  {f}")
        else:
            print(f"{case.name}: ok")
    elapsed = time.monotonic() - start
    summary = (f"{len(CASES)} cases, largest parameter error {overall_abs:.3e}, largest error / tolerance "
               f"{overall_ratio:.3f}, {elapsed:.1f} s")
    if failed:
        sys.exit(f"SUMMARY: FAIL ({', '.join(failed)}): {summary}")
    print(f"SUMMARY: PASS: {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
