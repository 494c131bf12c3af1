"""transformers' own TrainingArguments dumps as `memtune train --config` files.

    PY tests/interop/hf_training_arguments_test.py --memtune BIN --workdir DIR

For command lines of the kind our users run (LoRA and full fine-tuning, schedules with warmup,
evaluation and checkpoints every N steps, a checkpoint limit, gradient checkpointing, seeds),
`TrainingArguments(...).to_json_string()` of transformers itself is written to a file and given
to `memtune train --config FILE` (memtune's own flags, which TrainingArguments does not have,
on the command line). Then:
- every key of the dump is applied (run_args.json holds the same value), or named in memtune's
  "accepted and ignored" note, or unset (null, []) in the dump and a flag of `memtune train`
  (memtune's default applies);
- the meaning is the same: the learning rate logged at every step equals what transformers'
  scheduler (get_scheduler with TrainingArguments.get_warmup_steps) gives that step; the number
  of optimizer steps equals Trainer's for those epochs; evaluations happen at the steps
  eval_steps names; save_total_limit keeps Trainer's checkpoints;
- a value memtune cannot honour (optim adafactor, torch_compile true) stops the run with the
  key named, before anything is written.
"""

import json
import math
import os
import re
import shutil
import sys

import torch
import transformers

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "support"))
import memtune_cli  # noqa: E402
from byte_tokenizer import write_tokenizer  # noqa: E402
from numeric import assert_close, check  # noqa: E402

TEXTS = ["the quick brown fox", "pack my box with five", "sphinx of black quartz", "how vexingly quick",
         "waltz, bad nymph", "glib jocks quiz", "jackdaws love my big", "five boxing wizards"]
LR_RTOL = 1e-9


def run(args):
    return memtune_cli.run(args, check=False)


def ignored_in_note(stderr):
    m = re.search(r"accepted and ignored \(no effect on the result\): (.*)", stderr)
    return set(m.group(1).strip().split(", ")) if m else set()


def same_value(ours, theirs):
    """run_args.json's text of a flag against the dump's JSON value."""
    if isinstance(theirs, bool):
        return ours in ("true", "false") and (ours == "true") == theirs
    if isinstance(theirs, (int, float)):
        try:
            return float(ours) == float(theirs)
        except ValueError:
            return False
    if isinstance(theirs, list):
        return ours == ",".join(str(x) for x in theirs)
    return ours == str(theirs)


def hf_learning_rates(args, steps):
    """The learning rate of each optimizer step, as Trainer computes and logs it."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=args.learning_rate)
    sched = transformers.get_scheduler(args.lr_scheduler_type, opt, num_warmup_steps=args.get_warmup_steps(steps),
                                       num_training_steps=steps, scheduler_specific_kwargs=args.lr_scheduler_kwargs)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def hf_total_steps(args, examples):
    """Trainer's max_steps for a dataset of `examples` rows (world size 1)."""
    if args.max_steps > 0:
        return args.max_steps
    batches = math.ceil(examples / args.per_device_train_batch_size)
    return math.ceil(args.num_train_epochs * max(batches // args.gradient_accumulation_steps, 1))


CASES = {
    "lora_cosine_eval_checkpoints": (
        dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, gradient_accumulation_steps=2,
             learning_rate=2e-4, max_steps=6, lr_scheduler_type="cosine", warmup_ratio=0.2, weight_decay=0.01,
             max_grad_norm=0.5, logging_steps=1, save_strategy="steps", save_steps=3, save_total_limit=1,
             eval_strategy="steps", eval_steps=3, seed=7, data_seed=11, report_to="none",
             gradient_checkpointing=True, adam_beta2=0.98, adam_epsilon=1e-6),
        ["--tuner_type", "lora", "--lora_rank", 4]),
    "full_bf16_linear_epochs": (
        dict(per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-4, num_train_epochs=2,
             lr_scheduler_type="linear", warmup_steps=1, bf16=True, optim="adamw_torch", logging_steps=1,
             save_strategy="no", seed=3, label_smoothing_factor=0.1, dataloader_num_workers=4, run_name="seed-run",
             report_to=[]),
        ["--tuner_type", "full"]),
    "constant_with_warmup_min_lr": (
        dict(per_device_train_batch_size=4, learning_rate=5e-4, max_steps=4, lr_scheduler_type="cosine_with_min_lr",
             lr_scheduler_kwargs={"min_lr_rate": 0.1}, warmup_ratio=0.25, logging_steps=2, save_strategy="no",
             push_to_hub=False, disable_tqdm=True),
        ["--tuner_type", "lora"]),
}

REFUSED = {
    "optim": dict(optim="adafactor"),
    "torch_compile": dict(torch_compile=True),
}


def train(memtune, workdir, model, name, kwargs, extra, eval_file, train_file):
    out = os.path.join(workdir, name)
    shutil.rmtree(out, ignore_errors=True)
    args = transformers.TrainingArguments(output_dir=out, **kwargs)
    config = os.path.join(workdir, f"{name}.json")
    with open(config, "w") as f:
        f.write(args.to_json_string())
    cmd = [memtune, "train", "--config", config, "--model", model, "--train_file", train_file, "--max_length", 64,
           *extra]
    if args.eval_strategy != "no":
        cmd += ["--eval_file", eval_file]
    return args, config, out, run(cmd)


def check_case(memtune, workdir, model, name, kwargs, extra, eval_file, train_file, flags):
    args, config, out, p = train(memtune, workdir, model, name, kwargs, extra, eval_file, train_file)
    check(p.returncode == 0, lambda: f"{name}: memtune train --config exited {p.returncode}:\n{p.stderr}")
    dump = json.load(open(config))
    applied = json.load(open(os.path.join(out, "run_args.json")))
    ignored = ignored_in_note(p.stderr)
    for key, value in dump.items():
        if key == "lr_scheduler_kwargs" and value:  # applied as memtune's --min_lr_rate, its one key
            check(set(value) == {"min_lr_rate"} and same_value(applied.get("min_lr_rate", ""), value["min_lr_rate"]),
                  lambda: f"{name}: lr_scheduler_kwargs {value} ran as min_lr_rate {applied.get('min_lr_rate')}")
            applied[key] = value
        elif value is None or value == []:  # unset in the dump: memtune's default applies
            check(key in applied or key in ignored or f"--{key}" in flags,
                  lambda: f"{name}: {key} is unset in the dump and not a memtune flag nor named")
        elif key in applied:
            check(key not in ignored, f"{name}: {key} is both applied and named as ignored")
            check(same_value(applied[key], value),
                  lambda: f"{name}: {key}: TrainingArguments says {value!r}, memtune ran with {applied[key]!r}")
        elif key in ignored:
            continue
        else:
            check(False, lambda: f"{name}: {key} = {value!r} is neither applied nor named in the note")
    for key in kwargs:  # what the user set is applied or named, never silently dropped
        check(key in applied or key in ignored or dump[key] in (None, []),
              f"{name}: {key} set but neither applied nor named")

    state = json.load(open(os.path.join(out, "trainer_state.json")))
    steps = hf_total_steps(args, len(TEXTS))
    check(state["max_steps"] == steps, lambda: f"{name}: memtune ran {state['max_steps']} steps, Trainer {steps}")
    train_logs = [e for e in state["log_history"] if "loss" in e]
    want_lr = hf_learning_rates(args, steps)
    check([e["step"] for e in train_logs] == list(range(args.logging_steps, steps + 1, args.logging_steps)),
          lambda: f"{name}: logged at steps {[e['step'] for e in train_logs]}, logging_steps {args.logging_steps}")
    for e in train_logs:
        assert_close(e["learning_rate"], want_lr[e["step"] - 1], rtol=LR_RTOL,
                     what=f"{name}: learning rate of step {e['step']} against transformers' scheduler")
    if args.eval_strategy != "no":
        evals = [e["step"] for e in state["log_history"] if "eval_loss" in e]
        check(evals == list(range(args.eval_steps, steps + 1, args.eval_steps)),
              lambda: f"{name}: evaluated at steps {evals}, eval_steps {args.eval_steps}")
    if args.save_strategy == "steps":
        kept = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))
        saved = list(range(args.save_steps, steps + 1, args.save_steps))
        want = [f"checkpoint-{s}" for s in saved[-args.save_total_limit:]]
        check(kept == want, lambda: f"{name}: checkpoints {kept}, Trainer keeps {want}")
    print(f"ok    {name}: {len(dump)} keys; {sum(k in applied for k in dump)} applied, {len(ignored)} named as "
          f"ignored; {steps} steps, learning rates and evaluation steps as Trainer's", flush=True)


def main():
    a = memtune_cli.test_arguments()
    model = os.path.join(a.workdir, "model")
    p = run([a.memtune, "init-model", "--preset", "tiny", "--out", model])
    check(p.returncode == 0, lambda: p.stderr)
    write_tokenizer(model)
    train_file = os.path.join(a.workdir, "train.jsonl")
    eval_file = os.path.join(a.workdir, "eval.jsonl")
    for path, texts in ((train_file, TEXTS), (eval_file, TEXTS[:4])):
        with open(path, "w") as f:
            for t in texts:
                f.write(json.dumps({"text": t}) + "\n")
    flags = run([a.memtune, "train", "--help"]).stdout
    print(f"transformers {transformers.__version__}")
    failures = []
    for name, (kwargs, extra) in CASES.items():
        try:
            check_case(a.memtune, a.workdir, model, name, kwargs, extra, eval_file, train_file, flags)
        except AssertionError as e:
            failures.append(name)
            print(f"FAIL  {name}: {e}", flush=True)
    for key, kwargs in REFUSED.items():
        name = f"refused_{key}"
        _, _, out, p = train(a.memtune, a.workdir, model, name, dict(kwargs, max_steps=1), [], eval_file, train_file)
        if p.returncode == 0 or f'"{key}"' not in p.stderr or os.path.exists(out):
            failures.append(name)
            print(f"FAIL  {name}: exit {p.returncode}, output dir written: {os.path.exists(out)}\n{p.stderr}")
        else:
            print(f"ok    {name}: {p.stderr.strip().splitlines()[-1]}")
    print(f"{len(CASES) + len(REFUSED) - len(failures)} passed, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
