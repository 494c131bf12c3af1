"""memtune's loss and gradients against transformers' and PEFT's own autograd.

    PY tests/interop/hf_gradients_test.py --memtune BIN --workdir DIR [--families qwen2,qwen3,llama]

PY is the pinned Hugging Face environment (scripts/prepare-hf-env.sh). The project's PyTorch
reference (tools/qwen2_reference.py) is ours; this check's oracle is not: for Qwen2.5, Qwen3 and
Llama 3 (memtune's tiny presets), on one checkpoint and one batch,

1. full fine-tuning: `memtune dump` writes the loss and the gradient of every parameter;
   AutoModelForCausalLM.from_pretrained on the same directory, in float32, gives its loss with
   `labels=` and loss.backward() the gradient of every parameter (the tied head's included in
   the embedding's, as memtune's is);
2. LoRA: an adapter `memtune train --tuner_type lora` wrote, loaded by PEFT
   (PeftModel.from_pretrained, is_trainable) on the same base: `memtune dump --adapter` against
   PEFT's loss and the gradient of every lora_A and lora_B, and no base gradient on either side.

Both sides have the same tensors, the same shapes, and every gradient is within GRAD_RTOL of the
largest |gradient| of its tensor (a NaN or an infinity fails, tests/support/numeric.py). The
worst error of each tensor is printed with its tolerance.

Normalization: memtune's losses return sums over target tokens; `memtune dump` divides the loss
and every gradient once by the batch's number of target tokens, which is what transformers'
mean cross-entropy over the labels that are not -100 differentiates, so both are the gradient
of the same mean. The batch has rows of unequal length, right-padded with labels -100, so a
normalizer counting padding, or rows, instead of target tokens shows.

The checkpoint: memtune's config and tensor names, with every value rewritten here: matrices
N(0, INIT_STD) (0.02 would leave attention almost uniform and hide a 1% error; see
tests/interop/hf_models_test.py), norm weights 1 + N(0, 0.2) and q/k/v biases (Qwen2.5)
N(0, 0.3), so that no gradient is the one of a unit norm or a zero bias. The adapter is trained
at a high learning rate so that lora_B is far from PEFT's zero initialization (with B = 0,
lora_A's gradient is zero and shows nothing).

Exit status 0 only if every check passes.
"""

import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "support"))
import memtune_cli  # noqa: E402
from byte_tokenizer import EOS_ID, write_tokenizer  # noqa: E402
from hf_checks import dtype_argument, run_families  # noqa: E402
from numeric import assert_close, check, difference  # noqa: E402

import peft  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402
from safetensors.torch import load_file as load_torch, save_file as save_torch  # noqa: E402

PRESETS = {"qwen2": "tiny", "qwen3": "tiny-qwen3", "llama": "tiny-llama"}
# The adapter of each family: rank, alpha and targets vary, Llama's is rank-stabilized.
LORA = {"qwen2": ["--lora_rank", 4, "--lora_alpha", 8, "--target_modules", "all-linear"],
        "qwen3": ["--lora_rank", 8, "--lora_alpha", 16, "--target_modules", "all-linear"],
        "llama": ["--lora_rank", 4, "--lora_alpha", 8, "--use_rslora",
                  "--target_modules", "q_proj", "v_proj", "o_proj", "down_proj"]}
INIT_STD = 0.1
# float32 on both sides, summed in different orders: the worst error measured on these cases is
# 1.8e-6 of a tensor's largest |gradient| and 8e-8 of the loss (one float32 step); a gradient 1%
# off is a thousand times the tolerance.
GRAD_RTOL = 1e-5
LOSS_RTOL = 1e-6
TEXTS = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs!",
         "sphinx of black quartz, judge my vow", "how vexingly quick daft zebras jump; 0123"]


def run(args):
    return memtune_cli.run(args).stdout


def rewrite_weights(model_dir, seed):
    """Replaces every value of model_dir/model.safetensors (float32), keeping names and shapes."""
    path = os.path.join(model_dir, "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in load_torch(path).items():
        x = torch.randn(t.shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1.0 + 0.2 * x
        elif name.endswith(".bias"):
            x = 0.3 * x
        else:
            x = INIT_STD * x
        tensors[name] = x
    save_torch(tensors, path, metadata={"format": "pt"})


def batch():
    """Byte ids + EOS per text, right-padded with EOS; labels -100 on the padding."""
    seqs = [list(t.encode()) + [EOS_ID] for t in TEXTS]
    n = max(len(s) for s in seqs)
    ids = [s + [EOS_ID] * (n - len(s)) for s in seqs]
    labels = [s + [-100] * (n - len(s)) for s in seqs]
    return ids, labels


def memtune_dump(memtune, workdir, model_dir, adapter=None):
    ids, labels = batch()
    inp = os.path.join(workdir, "dump_in.json")
    out = os.path.join(workdir, "dump_out.safetensors")
    with open(inp, "w") as f:
        json.dump({"input_ids": ids, "labels": labels}, f)
    run([memtune, "dump", "--model", model_dir, "--input", inp, "--out", out] +
        (["--adapter", adapter] if adapter else []))
    return load_file(out)


def hf_base(model_dir):
    """The checkpoint in transformers, float32, every tensor read."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, **dtype_argument(torch.float32), output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        check(not info[key], lambda: f"{model_dir}: transformers reports {key} {info[key]}")
    return model.eval()  # no dropout; autograd is on all the same


def hf_loss_and_grads(model, name_of):
    """transformers' mean loss over the batch's targets and, after backward, the gradient of
    every trainable parameter under the name memtune gives it (name_of)."""
    ids, labels = batch()
    loss = model(input_ids=torch.tensor(ids), labels=torch.tensor(labels)).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            check(p.grad is not None, f"transformers computed no gradient for {name}")
            grads["grad." + name_of(name)] = p.grad.numpy()
    return float(loss), grads


def compare(what, ours, loss, grads):
    """memtune's dump against transformers' loss and gradients; prints each tensor's error."""
    check(set(ours) - {"logits", "loss"} == set(grads),
          lambda: f"{what}: gradients differ: memtune only {sorted(set(ours) - set(grads) - {'logits', 'loss'})}, "
                  f"transformers only {sorted(set(grads) - set(ours))}")
    d = assert_close(ours["loss"], loss, rtol=LOSS_RTOL, what=f"{what}: loss")
    print(f"      {'loss':<70} {abs(loss):>10.4g} {d.worst:>10.3g} {d.worst / abs(loss):>10.3g}")
    worst = 0.0
    for name in sorted(grads):
        d = difference(ours[name], grads[name])
        check(not d.problem, lambda: f"{what}: {name}: {d.problem}")
        check(d.scale > 0, f"{what}: transformers' {name} is zero: the comparison shows nothing")
        rel = d.worst / d.scale
        worst = max(worst, rel)
        print(f"      {name:<70} {d.scale:>10.4g} {d.worst:>10.3g} {rel:>10.3g}")
        assert_close(ours[name], grads[name], rtol=GRAD_RTOL, what=f"{what}: {name}")
    print(f"      {what}: {len(grads)} gradients, worst error {worst:.3g} of the tensor's largest |gradient| "
          f"(tolerance {GRAD_RTOL:g})")


def family_checks(memtune, workdir, family, checks):
    base = os.path.join(workdir, family, "base")
    run([memtune, "init-model", "--preset", PRESETS[family], "--out", base, "--torch_dtype", "float32"])
    rewrite_weights(base, seed={"qwen2": 1, "qwen3": 2, "llama": 3}[family])
    write_tokenizer(base)
    print(f"      {'tensor':<70} {'max|want|':>10} {'abs err':>10} {'rel err':>10}")

    with checks.case(f"{family}: full fine-tuning, memtune dump against transformers' backward"):
        loss, grads = hf_loss_and_grads(hf_base(base), lambda name: name)
        compare(f"{family} full", memtune_dump(memtune, workdir, base), loss, grads)

    with checks.case(f"{family}: LoRA, memtune dump --adapter against PEFT's backward"):
        train_file = os.path.join(workdir, "train.jsonl")
        with open(train_file, "w") as f:
            for t in TEXTS:
                f.write(json.dumps({"text": t}) + "\n")
        adapter = os.path.join(workdir, family, "adapter")
        run([memtune, "train", "--model", base, "--train_file", train_file, "--output_dir", adapter,
             "--tuner_type", "lora", "--lora_dropout", 0, *LORA[family], "--per_device_train_batch_size", 2,
             "--max_steps", 3, "--learning_rate", 5e-2, "--lr_scheduler_type", "constant", "--save_strategy", "no",
             "--logging_steps", 1, "--max_length", 64])
        smallest_b = min(float(v.std()) for k, v in
                         load_file(os.path.join(adapter, "adapter_model.safetensors")).items() if "lora_B" in k)
        check(smallest_b > INIT_STD / 2, f"the trained adapter has a lora_B of std {smallest_b:.3g}: too near zero")
        model = peft.PeftModel.from_pretrained(hf_base(base), adapter, is_trainable=True)
        # PEFT names a parameter by its adapter (".lora_A.default.weight"); the file, and memtune, do not.
        loss, grads = hf_loss_and_grads(model, lambda name: name.replace(".default.", "."))
        check(grads and all(".lora_A." in k or ".lora_B." in k for k in grads),
              lambda: f"PEFT trains more than the adapter: {sorted(grads)}")
        compare(f"{family} LoRA", memtune_dump(memtune, workdir, base, adapter), loss, grads)


if __name__ == "__main__":
    run_families(family_checks)
