#!/usr/bin/env python3
"""Hugging Face Trainer (+ PEFT) measured the way our users run it, beside memtune's benchmarks.

Run it with the pinned Hugging Face environment (`scripts/prepare-hf-env.sh | tail -n 1`: torch,
transformers, PEFT, accelerate of tools/hf-oracle/requirements.txt); scripts/bench-train.sh and
scripts/bench-eval.sh do. One measurement per process: peak RSS (getrusage ru_maxrss) is the
whole process's, importing torch and loading the model included, as memtune's is.

    hf_trainer_bench.py train --model DIR --tokenizer DIR --data FILE --memtune BIN --steps N
                              [--tuner full|lora] [--precision float32|bf16]
        transformers.Trainer on the bench model (AutoModelForCausalLM, float32 weights) and the
        bench's JSONL {"text": ...} data, tokenized with AutoTokenizer from the tokenizer
        directory memtune uses, the text's ids followed by the eos token as memtune's text format
        makes them (every line is checked against `memtune tokenize`; the run stops if any id
        differs). per_device_train_batch_size 4, max_length 512 (a longer example stops the run:
        the bench data have none), N optimizer steps (max_steps), learning rate 1e-4 constant,
        AdamW (adamw_torch, weight decay 0), max_grad_norm 1, use_cpu, no saving, no evaluation,
        report_to none, dataloader_num_workers 0, torch threads = OMP_NUM_THREADS (else nproc).
        --tuner lora: PEFT get_peft_model, r 8, alpha 32, dropout 0 on q/k/v/o/gate/up/down_proj.
        --precision bf16: TrainingArguments(bf16=True), i.e. autocast to bfloat16 on the CPU with
        float32 weights, gradients and optimizer state.
        --device cuda (scripts/device-check.sh): on the GPU, with fused AdamW (adamw_torch_fused),
        the step timed between torch.cuda.synchronize() calls, and torch.cuda.max_memory_allocated
        reported; --batch sets per_device_train_batch_size (default 4).
        tokens/s: per step, the batch's non-pad tokens (its attention mask's sum) over the wall
        time from the TrainerCallback's on_step_begin to its on_step_end (time.perf_counter: the
        forward, loss, backward, clipping, AdamW, zero_grad; the batch is already collated),
        averaged over the steps after the first (with one step, that step).
        Prints one JSON line: tokens_per_s, timed_steps, peak_rss_bytes and the versions.

    hf_trainer_bench.py eval --model DIR --num_sequences S --seq T [--mode full|argmax|batch|memtune]
                             [--data FILE --tokenizer DIR --memtune BIN]
        Trainer.evaluate, per_device_eval_batch_size 4, eval_accumulation_steps unset, with the
        compute_metrics users write for token accuracy:
          full:    compute_metrics receives the logits of the whole eval set (the evaluation loop
                   concatenates every batch's [4, T, V] float32 logits) and takes their argmax;
          argmax:  preprocess_logits_for_metrics returns logits.argmax(-1), so only ids are kept;
          batch:   batch_eval_metrics=True, the same preprocess, compute_metrics counting per batch;
          memtune: memtune.Trainer (PYTHONPATH holding the package) with argmax's two functions,
                   unchanged (the logits reach preprocess a [rows, V] chunk at a time).
        The eval set: the first S lines of --data (tokenized as in train, at most T tokens), or
        without --data S random sequences of T tokens (seed 0). `seconds` is Trainer.evaluate's
        wall time (not importing or loading). Prints one JSON line: peak_rss_bytes, seconds,
        num_sequences, mode, eval_loss, token_accuracy and the versions.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import peft
import torch
import transformers
from packaging.version import Version
from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer,
                          TrainerCallback, TrainingArguments)

BATCH = 4
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def threads():
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else os.cpu_count()


def versions():
    return {"transformers": transformers.__version__, "peft": peft.__version__, "torch": torch.__version__}


def peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kilobytes


def fail(message):
    sys.exit(f"hf_trainer_bench: {message}")


def tokenize_text_file(path, tokenizer_dir, memtune, max_length, limit=None):
    """The text of each {"text": ...} line encoded by AutoTokenizer, then the eos token: memtune's
    text format (add_special_tokens, which for Qwen2 adds nothing, then eos). Every line's ids are
    compared with `memtune tokenize --add_special_tokens` and the eos with memtune's decoding of it."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    if tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        fail(f"{tokenizer_dir}: the tokenizer needs an eos and a pad token")
    if tokenizer.pad_token_id == tokenizer.eos_token_id:
        fail("the pad token is the eos token: the collator would mask the eos labels memtune trains on")
    with open(path) as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    if limit is not None:
        if len(texts) < limit:
            fail(f"{path} has {len(texts)} examples, fewer than the {limit} asked for")
        texts = texts[:limit]
    ids = [tokenizer(text, add_special_tokens=True)["input_ids"] for text in texts]
    # memtune's own encoding of the same texts (lines of JSON strings) and of the eos id.
    lines = "".join(json.dumps(text) + "\n" for text in texts)
    run = subprocess.run([memtune, "tokenize", "--tokenizer", tokenizer_dir, "--add_special_tokens"],
                         input=lines, capture_output=True, text=True)
    if run.returncode:
        fail(f"memtune tokenize failed ({run.returncode}): {run.stderr.strip()}")
    theirs = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    if len(theirs) != len(ids):
        fail(f"memtune tokenize returned {len(theirs)} lines for {len(ids)} texts")
    for n, (a, b) in enumerate(zip(ids, theirs), 1):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            fail(f"{path}:{n}: AutoTokenizer and memtune tokenize differ at token {at} "
                 f"(lengths {len(a)} and {len(b)}; {a[at:at + 3]} against {b[at:at + 3]})")
    run = subprocess.run([memtune, "tokenize", "--tokenizer", tokenizer_dir, "--decode"],
                         input=json.dumps([tokenizer.eos_token_id]) + "\n", capture_output=True, text=True)
    if run.returncode or json.loads(run.stdout.strip() or "null") != tokenizer.eos_token:
        fail(f"memtune decodes the eos id {tokenizer.eos_token_id} as {run.stdout.strip()!r}, "
             f"not {tokenizer.eos_token!r}: {run.stderr.strip()}")
    examples = []
    for n, example in enumerate(ids, 1):
        example = example + [tokenizer.eos_token_id]
        if len(example) > max_length:
            fail(f"{path}:{n}: {len(example)} tokens, over max_length {max_length} (memtune would delete it)")
        examples.append({"input_ids": example})
    return tokenizer, examples


def dtype_argument(dtype):
    """from_pretrained's dtype keyword: `dtype` from transformers 4.56 on (5 deprecates
    `torch_dtype`), `torch_dtype` before it (4.51 takes no `dtype`)."""
    return {"dtype": dtype} if Version(transformers.__version__).release >= (4, 56) else {"torch_dtype": dtype}


def load_model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, **dtype_argument(torch.float32))


def common_arguments(output_dir, device="cpu", **kwargs):
    return TrainingArguments(output_dir=output_dir, use_cpu=device == "cpu", report_to="none", save_strategy="no",
                             eval_strategy="no", dataloader_num_workers=0, disable_tqdm=True,
                             log_level="warning", **kwargs)


class StepTimer(TrainerCallback):
    """Wall time of every optimizer step, from on_step_begin to on_step_end."""

    def __init__(self, cuda=False):
        self.seconds, self.begin, self.cuda = [], None, cuda

    def sync(self):
        if self.cuda:  # the GPU's queued work belongs to the step that queued it
            torch.cuda.synchronize()

    def on_step_begin(self, args, state, control, **kwargs):
        self.sync()
        self.begin = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.sync()
        self.seconds.append(time.perf_counter() - self.begin)


class TokenCountingTrainer(Trainer):
    """Trainer, unchanged, that also notes each step's non-pad tokens (gradient accumulation is 1:
    one training_step per optimizer step)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.step_tokens = []

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.step_tokens.append(int(inputs["attention_mask"].sum()))
        return super().training_step(model, inputs, num_items_in_batch)


def train(args):
    torch.set_num_threads(threads())
    tokenizer, examples = tokenize_text_file(args.data, args.tokenizer, args.memtune, args.max_length)
    model = load_model(args.model)
    if args.tuner == "lora":
        config = peft.LoraConfig(r=8, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS,
                                 bias="none", task_type="CAUSAL_LM")
        model = peft.get_peft_model(model, config)
    cuda = args.device == "cuda"
    timer = StepTimer(cuda)
    with tempfile.TemporaryDirectory(prefix="hf-trainer-bench-") as output_dir:
        training_args = common_arguments(
            output_dir, args.device, per_device_train_batch_size=args.batch, gradient_accumulation_steps=1,
            max_steps=args.steps, learning_rate=1e-4, lr_scheduler_type="constant", warmup_steps=0,
            optim="adamw_torch_fused" if cuda else "adamw_torch", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
            max_grad_norm=1.0, bf16=args.precision == "bf16", logging_strategy="no", seed=42,
            label_names=["labels"])
        trainer = TokenCountingTrainer(
            model=model, args=training_args, train_dataset=examples, callbacks=[timer],
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
        torch.set_num_threads(threads())  # after accelerate's setup, whatever it did
        trainer.train()
    if len(timer.seconds) != args.steps or len(trainer.step_tokens) != args.steps:
        fail(f"expected {args.steps} steps, timed {len(timer.seconds)} and counted {len(trainer.step_tokens)}")
    timed = list(zip(trainer.step_tokens, timer.seconds))
    timed = timed[1:] or timed  # the first step is a warm-up; with one step (a smoke test) it is all there is
    print(json.dumps({
        "tokens_per_s": sum(t / s for t, s in timed) / len(timed),
        "timed_steps": len(timed),
        "peak_rss_bytes": peak_rss_bytes(),
        **versions(),
        "seconds_per_step": sum(s for _, s in timed) / len(timed),
        "tokens_per_step": sum(t for t, _ in timed) / len(timed),
        "tuner": args.tuner,
        "precision": args.precision,
        "threads": torch.get_num_threads(),
        "attn_implementation": model.config._attn_implementation,
        "trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "device": args.device,
        "batch": args.batch,
        **({"cuda_max_memory_allocated_bytes": torch.cuda.max_memory_allocated(),
            "cuda_device": torch.cuda.get_device_name()} if cuda else {}),
    }))


def token_accuracy(preds, labels):
    """The metric as users write it: predictions at t against labels at t + 1, -100 skipped."""
    preds, labels = preds[:, :-1], labels[:, 1:]
    mask = labels != -100
    return float((preds[mask] == labels[mask]).mean())


def compute_metrics_full(eval_pred):
    logits, labels = eval_pred.predictions, eval_pred.label_ids
    return {"token_accuracy": token_accuracy(np.argmax(logits, axis=-1), labels)}


def compute_metrics_ids(eval_pred):
    return {"token_accuracy": token_accuracy(eval_pred.predictions, eval_pred.label_ids)}


class BatchTokenAccuracy:
    """The same metric in Trainer's batch_eval_metrics protocol: counts per batch (tensors)."""

    def __init__(self):
        self.hits = self.total = 0

    def __call__(self, eval_pred, compute_result):
        preds, labels = eval_pred.predictions[:, :-1], eval_pred.label_ids[:, 1:]
        mask = labels != -100
        self.hits += int((preds[mask] == labels[mask]).sum())
        self.total += int(mask.sum())
        if not compute_result:
            return {}
        result = {"token_accuracy": self.hits / self.total}
        self.hits = self.total = 0
        return result


def preprocess_logits_for_metrics(logits, labels):
    return logits.argmax(dim=-1)


def evaluate(args):
    torch.set_num_threads(threads())
    model = load_model(args.model) if args.mode != "memtune" else None  # memtune loads its own
    if args.data:
        if not (args.tokenizer and args.memtune):
            fail("eval --data needs --tokenizer and --memtune (the ids are checked against memtune's)")
        tokenizer, examples = tokenize_text_file(args.data, args.tokenizer, args.memtune, args.seq,
                                                 limit=args.num_sequences)
        source = f"the first {args.num_sequences} examples of {args.data}"
    else:
        gen = torch.Generator().manual_seed(0)
        with open(os.path.join(args.model, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        ids = torch.randint(vocab_size, (args.num_sequences, args.seq), generator=gen)
        examples = [{"input_ids": row.tolist()} for row in ids]
        tokenizer = None
        source = f"{args.num_sequences} x {args.seq} random tokens"
    if tokenizer is not None:
        collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    else:  # equal lengths: no padding
        def collator(batch):
            ids = torch.tensor([b["input_ids"] for b in batch])
            return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    with tempfile.TemporaryDirectory(prefix="hf-trainer-bench-") as output_dir:
        if args.mode == "memtune":
            # memtune.Trainer with the same compute_metrics and preprocess_logits_for_metrics; the
            # labels are the ids, as DataCollatorForLanguageModeling makes them (no padding here:
            # each example is its own length).
            import memtune
            mt_args = memtune.TrainingArguments(output_dir=output_dir, per_device_eval_batch_size=BATCH,
                                                max_length=args.seq)
            trainer = memtune.Trainer(model=args.model, args=mt_args, eval_dataset=examples,
                                      processing_class=args.tokenizer, compute_metrics=compute_metrics_ids,
                                      preprocess_logits_for_metrics=preprocess_logits_for_metrics)
        else:
            eval_args = common_arguments(output_dir, per_device_eval_batch_size=BATCH,
                                         batch_eval_metrics=args.mode == "batch")
            if eval_args.eval_accumulation_steps is not None:
                fail("eval_accumulation_steps must be unset")
            metrics_fn = {"full": compute_metrics_full, "argmax": compute_metrics_ids,
                          "batch": BatchTokenAccuracy()}[args.mode]
            trainer = Trainer(model=model, args=eval_args, eval_dataset=examples, data_collator=collator,
                              compute_metrics=metrics_fn,
                              preprocess_logits_for_metrics=None if args.mode == "full"
                              else preprocess_logits_for_metrics)
        torch.set_num_threads(threads())
        start = time.perf_counter()
        metrics = trainer.evaluate()
        seconds = time.perf_counter() - start
    print(json.dumps({
        "peak_rss_bytes": peak_rss_bytes(),
        "seconds": seconds,
        "num_sequences": args.num_sequences,
        "mode": args.mode,
        "sequences_per_s": args.num_sequences / seconds,
        "eval_loss": metrics["eval_loss"],
        "token_accuracy": metrics["eval_token_accuracy"],
        "data": source,
        "threads": torch.get_num_threads(),
        **versions(),
    }))


def main(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_train = sub.add_parser("train", help="time Trainer.train steps, full or LoRA, float32 or bf16 autocast")
    p_train.add_argument("--model", required=True)
    p_train.add_argument("--tokenizer", required=True)
    p_train.add_argument("--data", required=True, help='JSONL of {"text": ...} lines')
    p_train.add_argument("--memtune", required=True, help="memtune binary, to check the token ids")
    p_train.add_argument("--steps", type=int, required=True)
    p_train.add_argument("--max_length", type=int, default=512)
    p_train.add_argument("--tuner", choices=("full", "lora"), default="full")
    p_train.add_argument("--precision", choices=("float32", "bf16"), default="float32")
    p_train.add_argument("--batch", type=int, default=BATCH, help="per_device_train_batch_size")
    p_train.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                         help="cuda: the GPU, fused AdamW, torch.cuda.max_memory_allocated reported")
    p_eval = sub.add_parser("eval", help="peak RSS and time of Trainer.evaluate with token-accuracy metrics")
    p_eval.add_argument("--model", required=True)
    p_eval.add_argument("--num_sequences", type=int, required=True)
    p_eval.add_argument("--seq", type=int, default=512)
    p_eval.add_argument("--mode", choices=("full", "argmax", "batch", "memtune"), default="full",
                        help="Trainer with full logits, with preprocess_logits_for_metrics (argmax), with "
                             "batch_eval_metrics, or memtune.Trainer with the argmax mode's functions")
    p_eval.add_argument("--data", help='JSONL of {"text": ...} lines (default: random tokens)')
    p_eval.add_argument("--tokenizer")
    p_eval.add_argument("--memtune")
    args = parser.parse_args(argv)
    if args.command == "train":
        if args.steps < 1 or args.max_length < 2:
            parser.error("train: --steps must be positive and --max_length at least 2")
        train(args)
    else:
        if args.num_sequences < 1 or args.seq < 2:
            parser.error("eval: --num_sequences must be positive and --seq at least 2")
        evaluate(args)


if __name__ == "__main__":
    main(sys.argv[1:])
