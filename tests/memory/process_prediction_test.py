#!/usr/bin/env python3
"""The whole process's memory, predicted before a run, against what the kernel measured.

Every run records two figures in memory.json: process_predicted_peak_bytes (made before the
model's memory exists, from the plan and the measured startup and data stages) and
process_peak_rss_bytes (getrusage, after the run). Over a matrix of runs (full / LoRA x gradient
checkpointing x float32 / bfloat16 storage / --bf16 mixed-precision training, the same models evaluated and generating, and a 2-rank data-parallel
run, and training and generation on the vulkan backend where a device is usable) the prediction
must be within 10% of the measurement and never more than 5% below it.
`memtune plan` with the run's own flags must predict what the run predicted, and a --host_memory
budget below the prediction must stop the run before it starts while one just above it lets the
run complete within it. The model has Qwen2.5's real vocabulary, so the logits and the embedding
are the sizes a user meets."""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
# check() rather than assert: python -O (PYTHONOPTIMIZE) would remove assert statements.
sys.path.insert(0, str(ROOT / "tests" / "support"))
from numeric import check  # noqa: E402

SYSTEM = "Classify the Debian package by its section."


def run(cmd, expect_ok=True):
    r = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    if expect_ok and r.returncode != 0:
        sys.exit(f"failed ({r.returncode}): {' '.join(map(str, cmd))}\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
    return r


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memtune", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    tokenizer = os.environ.get("MEMTUNE_TOKENIZER_DIR")
    if not tokenizer:
        sys.exit("MEMTUNE_TOKENIZER_DIR must name the prepared Qwen2.5 tokenizer (scripts/prepare-tokenizer.sh)")
    work = pathlib.Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    memtune = args.memtune

    # The vulkan runs need a device `memtune devices --json` lists as the one --backend vulkan
    # takes. Without one they are skipped, and said so; with MEMTUNE_REQUIRE_ALL_TESTS=1 (CI, where
    # lavapipe is installed) that is a failure, reported before the other runs.
    require_all = os.environ.get("MEMTUNE_REQUIRE_ALL_TESTS") == "1"
    devices = run([memtune, "devices", "--json"], expect_ok=False)
    try:
        listed = json.loads(devices.stdout) if devices.returncode == 0 else None
    except json.JSONDecodeError:
        listed = None
    vulkan_why = None
    if listed is None or listed.get("backend_vulkan_device") is None:
        vulkan_why = (f"`memtune devices --json` exited with {devices.returncode}"
                      f"{'' if listed is None else ', naming no device for --backend vulkan'}:\n"
                      f"{devices.stdout}{devices.stderr}")
    check(not require_all or vulkan_why is None, lambda: f"MEMTUNE_REQUIRE_ALL_TESTS=1 and no usable Vulkan device: "
                                                         f"{vulkan_why}")

    model = work / "model"
    run([memtune, "init-model", "--preset", "tiny", "--out", model, "--seed", "3", "--set", "vocab_size=151936",
         "--set", "hidden_size=128", "--set", "intermediate_size=384", "--set", "num_hidden_layers=4",
         "--set", "num_attention_heads=4", "--set", "num_key_value_heads=2"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(pathlib.Path(tokenizer) / name, model / name)
    data = ROOT / "examples" / "debian-sections"
    train_file, eval_file = work / "train.jsonl", work / "eval.jsonl"
    train_file.write_text("".join((data / "train.jsonl").read_text().splitlines(keepends=True)[:400]))
    eval_file.write_text("".join((data / "eval.jsonl").read_text().splitlines(keepends=True)[:120]))

    rows = []  # (name, predicted, measured)

    def record(name, memory):
        predicted, measured = memory["process_predicted_peak_bytes"], memory["process_peak_rss_bytes"]
        rows.append((name, predicted, measured))

    def train_flags(out, tuner, ckpt, dtype, model=model):
        precision = ["--bf16"] if dtype == "mixed" else ["--torch_dtype", dtype]
        flags = ["--model_name_or_path", model, "--train_file", train_file, "--output_dir", out, "--tuner_type", tuner,
                 *precision, "--per_device_train_batch_size", "8", "--max_length", "256", "--max_steps",
                 "4", "--logging_steps", "2", "--save_strategy", "no", "--system", SYSTEM]
        return flags + (["--gradient_checkpointing"] if ckpt else [])

    adapter = None
    for tuner in ("full", "lora"):
        for ckpt in (False, True):
            for dtype in ("float32", "bfloat16", "mixed"):
                name = f"train {tuner}{' ckpt' if ckpt else ''} {dtype}"
                out = work / name.replace(" ", "_")
                flags = train_flags(out, tuner, ckpt, dtype)
                run([memtune, "train"] + flags)
                memory = json.loads((out / "memory.json").read_text())
                record(name, memory)
                # The same command line with `plan` predicts what the run predicted.
                plan = json.loads(run([memtune, "plan"] + flags + ["--json"]).stdout)
                check(plan["peak_bytes"] == memory["arena_bytes"],
                      f"{name}: plan's arena peak {plan['peak_bytes']}, the run's arena {memory['arena_bytes']}")
                ratio = plan["process_peak_bytes"] / memory["process_predicted_peak_bytes"]
                check(0.97 < ratio < 1.03, f"{name}: plan predicts {plan['process_peak_bytes']}, the run "
                                           f"{memory['process_predicted_peak_bytes']}")
                if tuner == "lora" and not ckpt and dtype == "float32":
                    adapter = out
    # A small hidden size with the real vocabulary, full float32 fine-tuning: the head's GEMMs are
    # most of the work (OpenBLAS's per-thread packing of a whole [vocab, hidden] operand once
    # made the process ~2x the head's bytes larger than predicted).
    small = work / "model_small"
    run([memtune, "init-model", "--preset", "tiny", "--out", small, "--seed", "3", "--set", "vocab_size=151936"])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(pathlib.Path(tokenizer) / name, small / name)
    for label, extra in (("4 x 256", ["--per_device_train_batch_size", "4"]),
                         ("4 x 256 ckpt", ["--per_device_train_batch_size", "4", "--gradient_checkpointing"]),
                         ("2 x 2 x 256", ["--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2"])):
        name = f"train small full float32 {label}"
        out = work / name.replace(" ", "_")
        run([memtune, "train"] + train_flags(out, "full", False, "float32", model=small) + extra)
        record(name, json.loads((out / "memory.json").read_text()))
    for tuner in ("full", "lora"):
        for dtype in ("float32", "bfloat16"):
            name = f"eval {tuner} {dtype}"
            out = work / name.replace(" ", "_")
            cmd = [memtune, "eval", "--model_name_or_path", model, "--eval_file", eval_file, "--max_length", "256",
                   "--torch_dtype", dtype, "--system", SYSTEM, "--output_dir", out]
            run(cmd + (["--adapter", adapter] if tuner == "lora" else []))
            record(name, json.loads((out / "memory.json").read_text()))

    # Generation: the same model with its KV cache, 16 prompts decoded 8 at a time.
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {i}: which Debian section holds package {i}?"}) + "\n"
                               for i in range(16)))
    for tuner in ("full", "lora"):
        for dtype in ("float32", "bfloat16"):
            name = f"generate {tuner} {dtype}"
            cmd = [memtune, "generate", "--model_name_or_path", model, "--input", prompts, "--max_new_tokens", "32",
                   "--ignore_eos", "--max_num_seqs", "8", "--torch_dtype", dtype, "--json", "--output",
                   work / "generated.jsonl"]
            summary = json.loads(run(cmd + (["--adapter", adapter] if tuner == "lora" else [])).stdout.splitlines()[-1])
            record(name, summary)

    # The vulkan backend where a Vulkan device is usable (lavapipe in CI: the loader, the driver and
    # LLVM live in this process, in the startup term; the pipelines in the backend's runtime term):
    # small steps, lavapipe computes the 151936-row head slowly.
    if vulkan_why is None:
        for tuner in ("full", "lora"):
            name = f"train small {tuner} float32 (vulkan)"
            out = work / name.replace(" ", "_").replace("(", "").replace(")", "")
            flags = train_flags(out, tuner, False, "float32", model=small)
            flags[flags.index("--per_device_train_batch_size") + 1] = "1"
            flags[flags.index("--max_steps") + 1] = "2"
            run([memtune, "train", "--backend", "vulkan"] + flags)
            record(name, json.loads((out / "memory.json").read_text()))
        summary = json.loads(run([memtune, "generate", "--backend", "vulkan", "--model_name_or_path", small, "--input",
                                  prompts, "--max_new_tokens", "8", "--ignore_eos", "--max_num_seqs", "8", "--json",
                                  "--output", work / "generated.jsonl"]).stdout.splitlines()[-1])
        record("generate small float32 (vulkan)", summary)
    else:
        print(f"vulkan runs skipped (no usable Vulkan device): {vulkan_why}")
    vulkan_rows = [name for name, _, _ in rows if "(vulkan)" in name]
    check(not require_all or len(vulkan_rows) == 3,
          f"MEMTUNE_REQUIRE_ALL_TESTS=1: {len(vulkan_rows)} runs on vulkan, expected 3 ({vulkan_rows})")

    # Two data-parallel ranks: each rank's measured peak against the prediction (rank 0's).
    out = work / "dp2"
    r = run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", memtune, "train"] +
            train_flags(out, "full", False, "float32"))
    memory = json.loads((out / "memory.json").read_text())
    for rank in memory["ranks"]:
        record(f"train full float32, rank {rank['rank']} of 2",
               {"process_predicted_peak_bytes": memory["process_predicted_peak_bytes"],
                "process_peak_rss_bytes": rank["process_peak_rss_bytes"]})

    print(f"{'run':<36} {'predicted MiB':>14} {'measured MiB':>13} {'error':>8}")
    worst = None
    for name, predicted, measured in rows:
        error = (predicted - measured) / measured
        print(f"{name:<36} {predicted / 2**20:>14.2f} {measured / 2**20:>13.2f} {error:>+8.2%}")
        if worst is None or abs(error) > abs(worst[1]):
            worst = (name, error)
    print(f"worst case: {worst[0]} {worst[1]:+.2%}")
    for name, predicted, measured in rows:
        error = (predicted - measured) / measured
        check(error <= 0.10, f"{name}: predicted {predicted} is more than 10% above the measured {measured}")
        check(error >= -0.05, f"{name}: predicted {predicted} is more than 5% below the measured {measured}")

    # A budget below the prediction refuses to start, with the numbers; one just above it completes.
    predicted = json.loads((work / "train_full_float32" / "memory.json").read_text())["process_predicted_peak_bytes"]
    out = work / "budget_low"
    r = run([memtune, "train"] + train_flags(out, "full", False, "float32") +
            ["--host_memory", str(int(predicted * 0.97))], expect_ok=False)
    check(r.returncode == 1, f"a --host_memory budget below the prediction: exit status {r.returncode}, expected 1")
    check("--host_memory" in r.stderr and "predicted to need" in r.stderr and "process:" in r.stderr,
          f"the refusal does not give the numbers:\n{r.stderr}")
    check(not (out / "memory.json").exists() and not (out / "log.jsonl").exists(),
          f"{out}: the refused run wrote memory.json or log.jsonl")
    out = work / "budget_high"
    budget = int(predicted * 1.03)
    run([memtune, "train"] + train_flags(out, "full", False, "float32") + ["--host_memory", str(budget)])
    measured = json.loads((out / "memory.json").read_text())["process_peak_rss_bytes"]
    check(measured <= budget, f"--host_memory {budget}: the run measured {measured}, over the budget")
    print(f"--host_memory {budget}: completed, measured {measured}; {int(predicted * 0.97)}: refused before starting")


if __name__ == "__main__":
    main()
