#!/usr/bin/env python3
"""The README's demo, shortened (MEMTUNE_DEMO_QUICK=1: 100 training steps, a 120-example eval
subset), run end to end with the memtune binary under test. Checks what a user sees and gets:
the data statistics with the majority-class baseline, the plan against the small budget with the
configuration --fit picked, training and evaluation records, the real-size 7B plans, reports
written, the arena within its budget and the predicted process within 10% of its measured peak, label accuracy above twice the majority
baseline, and a second run that redoes nothing: both stages say they were already done with the
same settings, and no file of the training's or the evaluation's outputs was written again."""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

# check() rather than assert: python -O (PYTHONOPTIMIZE) would remove assert statements.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "support"))
from numeric import check  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--memtune", required=True)
    parser.add_argument("--workdir", required=True)
    args = parser.parse_args()
    root = pathlib.Path(__file__).resolve().parents[2]
    work = pathlib.Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    env = dict(os.environ, MEMTUNE_DEMO_QUICK="1", MEMTUNE_DEMO_OUT=str(work), MEMTUNE_BIN=args.memtune,
               OMP_WAIT_POLICY="PASSIVE")

    def demo():
        r = subprocess.run(["bash", str(root / "scripts" / "demo.sh")], env=env, capture_output=True, text=True)
        sys.stdout.write(r.stdout[-6000:])
        check(r.returncode == 0, lambda: f"demo failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
        return r.stdout

    out = demo()
    for text in ["3600 examples (format classification)", "labels: 12 classes", "majority-class baseline accuracy",
                 "does NOT fit in 384.00 MiB", "process fits in 640.00 MiB", "--fit:", "training with: --per_device_train_batch_size",
                 '"eval_label_accuracy"', "confusion matrix", "qwen2.5-7b: 7615616512 parameters",
                 "does NOT fit in 24.00 GiB", "fits in 24.00 GiB", "Hugging Face Trainer evaluation",
                 "report.html"]:
        check(text in out, f"missing from the demo's output: {text!r}")

    results = json.loads((work / "eval" / "eval_results.json").read_text())
    eval_lines = [json.loads(line) for line in (work / "eval.jsonl").read_text().splitlines()]
    labels = [r["label"] for r in eval_lines]
    baseline = max(labels.count(label) for label in set(labels)) / len(labels)
    check(results["eval_examples"] == 120, f"eval_examples is not 120: {results}")
    # The stated bar for the shortened run: more than twice the majority-class baseline (a NaN fails).
    check(results["label_accuracy"] > 2 * baseline,
          f"label_accuracy {results['label_accuracy']} is not above twice the majority baseline {baseline}")
    check(0 < results["macro_f1"] <= 1 and results["eval_loss"] > 0,
          f"macro_f1 not in (0, 1] or eval_loss not positive: {results}")

    log = [json.loads(line) for line in (work / "run" / "log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "eval_label_accuracy" in r]
    check([r["step"] for r in evals] == [50, 100], f"evaluations at steps other than 50 and 100: {evals}")
    train = [r for r in log if "loss" in r]
    check(train[-1]["loss"] < train[0]["loss"] / 2,
          f"the loss did not halve: first {train[0]['loss']}, last {train[-1]['loss']}")

    memory = json.loads((work / "run" / "memory.json").read_text())
    check(memory["arena_bytes"] == memory["arena_high_water_bytes"] <= 384 << 20,
          f"arena not equal to its high water mark within 384 MiB: {memory}")
    # The process as predicted before the run, against the kernel's measurement of it.
    predicted, measured = memory["process_predicted_peak_bytes"], memory["process_peak_rss_bytes"]
    check(measured <= 640 << 20, f"measured process peak above 640 MiB: {memory}")
    check(-0.05 <= (predicted - measured) / measured <= 0.10,
          f"predicted process peak {predicted} not within -5%..+10% of the measured {measured}")
    for report in [work / "run" / "report.html", work / "eval" / "report.html"]:
        html = report.read_text()
        check('data-chart="memory"' in html, f"{report}: no memory chart")
    check('data-chart="loss"' in (work / "run" / "report.html").read_text(), "run/report.html: no loss chart")

    # What the stages wrote, as the file system records it: a file written again (even with the
    # same bytes) gets a new modification time, a file replaced a new inode.
    def outputs():
        return {str(f.relative_to(work)): (f.stat().st_ino, f.stat().st_mtime_ns, f.stat().st_size)
                for stage in ["run", "eval"] for f in sorted((work / stage).rglob("*")) if f.is_file()}

    written = outputs()
    out = demo()
    check(out.count("already done with the same settings") == 2,
          lambda: f"the second run did not skip both stages:\n{out}")
    after = outputs()
    rewritten = sorted(f for f in written.keys() | after.keys() if written.get(f) != after.get(f))
    check(not rewritten, f"the second run wrote the first run's outputs again: {rewritten}")
    print(f"demo (shortened): label_accuracy {results['label_accuracy']:.4f} vs majority baseline {baseline:.4f}; "
          "the second run skipped both stages")


if __name__ == "__main__":
    main()
