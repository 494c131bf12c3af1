#!/usr/bin/env python3
"""The README's demo, shortened (MEMTUNE_DEMO_QUICK=1: 100 training steps, a 120-example eval
subset), run end to end with the memtune binary under test. Checks what a user sees and gets:
the data statistics with the majority-class baseline, the plan against the small budget with the
configuration --fit picked, training and evaluation records, the real-size 7B plans, reports
written, the arena within its budget and the predicted process within 10% of its measured peak, label accuracy above twice the majority
baseline, and a second run that redoes nothing."""
import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

# The checks below are assert statements: under python -O (PYTHONOPTIMIZE) they would vanish and
# the test pass without checking anything, so it refuses to run there.
if not __debug__:
    sys.exit(f"{__file__}: run without python -O / PYTHONOPTIMIZE (its checks are assert statements)")


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
        start = time.monotonic()
        r = subprocess.run(["bash", str(root / "scripts" / "demo.sh")], env=env, capture_output=True, text=True)
        sys.stdout.write(r.stdout[-6000:])
        assert r.returncode == 0, f"demo failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r.stdout, time.monotonic() - start

    out, first = demo()
    for text in ["3600 examples (format classification)", "labels: 12 classes", "majority-class baseline accuracy",
                 "does NOT fit in 384.00 MiB", "process fits in 640.00 MiB", "--fit:", "training with: --per_device_train_batch_size",
                 '"eval_label_accuracy"', "confusion matrix", "qwen2.5-7b: 7615616512 parameters",
                 "does NOT fit in 24.00 GiB", "fits in 24.00 GiB", "Hugging Face Trainer evaluation",
                 "report.html"]:
        assert text in out, f"missing from the demo's output: {text!r}"

    results = json.loads((work / "eval" / "eval_results.json").read_text())
    eval_lines = [json.loads(line) for line in (work / "eval.jsonl").read_text().splitlines()]
    labels = [r["label"] for r in eval_lines]
    baseline = max(labels.count(label) for label in set(labels)) / len(labels)
    assert results["eval_examples"] == 120, results
    # The stated bar for the shortened run: more than twice the majority-class baseline.
    assert results["label_accuracy"] > 2 * baseline, (results["label_accuracy"], baseline)
    assert 0 < results["macro_f1"] <= 1 and results["eval_loss"] > 0, results

    log = [json.loads(line) for line in (work / "run" / "log.jsonl").read_text().splitlines()]
    evals = [r for r in log if "eval_label_accuracy" in r]
    assert [r["step"] for r in evals] == [50, 100], evals
    train = [r for r in log if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"] / 2, (train[0]["loss"], train[-1]["loss"])

    memory = json.loads((work / "run" / "memory.json").read_text())
    assert memory["arena_bytes"] == memory["arena_high_water_bytes"] <= 384 << 20, memory
    # The process as predicted before the run, against the kernel's measurement of it.
    predicted, measured = memory["process_predicted_peak_bytes"], memory["process_peak_rss_bytes"]
    assert measured <= 640 << 20, memory
    assert -0.05 <= (predicted - measured) / measured <= 0.10, (predicted, measured)
    for report in [work / "run" / "report.html", work / "eval" / "report.html"]:
        html = report.read_text()
        assert 'data-chart="memory"' in html, report
    assert 'data-chart="loss"' in (work / "run" / "report.html").read_text()

    out, second = demo()
    assert out.count("already done with the same settings") == 2, out
    assert second < first / 2, (first, second)
    print(f"demo (shortened): label_accuracy {results['label_accuracy']:.4f} vs majority baseline {baseline:.4f}; "
          f"first run {first:.1f} s, second {second:.1f} s")


if __name__ == "__main__":
    main()
