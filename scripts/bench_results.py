#!/usr/bin/env python3
"""Benchmark results as files, and the tables generated from them.

  bench_results.py record NAME SETTINGS_JSON ROWS_JSON
      writes bench/results/NAME-<date>-<commit>-<machine>.json: the commit, the date, the machine
      (CPU model, whether it has AVX-512 or only AVX2, cores, threads used), the settings and the
      rows (each row: memtune's figures and the reference's from the same run, and their ratios;
      train and eval rows also hold Hugging Face Trainer's figures under "hf_trainer").
  bench_results.py tables
      regenerates every table between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->` in
      README.md and docs/benchmarks.md from the newest result file of NAME per machine.

Figures are only compared within one file: each comes from one run on one machine."""
import datetime
import glob
import json
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def machine():
    # The model name alone does not tell machines apart (virtual machines report "AMD EPYC" for
    # several generations with different vector units), so the family and model numbers join it.
    model, family, number, flags = "unknown", "", "", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip()
            elif key == "cpu family" and not family:
                family = value.strip()
            elif key == "model" and not number:
                number = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split())
    if family and number:
        model += f" (family {family}, model {number})"
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"
    # The matrix units bfloat16 products run on (oneDNN's choice follows them).
    if "amx_bf16" in flags:
        simd += " + AMX"
    elif "avx512_bf16" in flags:
        simd += " + BF16"
    return {"cpu": model, "simd": simd, "cores": os.cpu_count(),
            "threads": int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))}


def commit():
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return head + ("-dirty" if dirty else "")


def record(name, settings, rows):
    m = machine()
    now = datetime.datetime.now(datetime.timezone.utc)
    result = {"benchmark": name, "commit": commit(), "date": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "machine": m,
              "settings": settings, "rows": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = re.sub(r"[^a-z0-9]+", "-", f"{m['cpu']}-{m['cores']}c".lower()).strip("-")
    path = RESULTS / f"{name}-{now.strftime('%Y%m%d')}-{result['commit']}-{tag}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path.relative_to(ROOT)}")


def mib(b):
    return f"{b / 2**20:.1f} MiB"


def machine_text(r):
    m = r["machine"]
    return f"{m['cpu']}, {m['simd']}, {m['threads']} threads; commit {r['commit']}, {r['date'][:10]}"


def kernels_text(products, families):
    """The kernel each of `families` ran (a row's "products", backend/products.h), "-" for a row
    recorded before runs said it: "head_forward: oneDNN gemm:jit; ...", a family's kernels joined
    by " + " where it ran more than one."""
    if not products:
        return "-"
    parts = []
    for family in families:
        kernels = [p["kernel"] for p in products if p["family"] == family]
        if kernels:
            parts.append(f"{family}: {' + '.join(kernels)}")
    return "; ".join(parts) or "-"


# NAME -> (header, row formatter) for the generated tables.
def table_memory(results):
    lines = ["| run | machine | arena (plan) | process predicted | process measured (peak RSS) | error | "
             "arena resident |", "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        for row in r["rows"]:
            error = (row["predicted_bytes"] - row["measured_bytes"]) / row["measured_bytes"]
            lines.append(f"| {row['run']} | {machine_text(r)} | {mib(row['arena_bytes'])} | "
                         f"{mib(row['predicted_bytes'])} | {mib(row['measured_bytes'])} | {error:+.1%} | "
                         f"{mib(row['arena_resident_bytes'])} |")
    return lines


def table_speed(results):
    lines = ["| run | machine | memtune tok/s | PyTorch tok/s | speed | memtune RSS | PyTorch RSS | memory |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        for row in r["rows"]:
            mt, pt = row["memtune"], row["reference"]
            lines.append(f"| {row['run']} | {machine_text(r)} | {mt['tokens_per_s']:.0f} | {pt['tokens_per_s']:.0f} | "
                         f"{mt['tokens_per_s'] / pt['tokens_per_s']:.2f}x | {mib(mt['peak_rss_bytes'])} | "
                         f"{mib(pt['peak_rss_bytes'])} | {mt['peak_rss_bytes'] / pt['peak_rss_bytes']:.3f}x |")
    return lines


def table_train(results):
    """memtune train against the PyTorch reference (float32 rows) and Hugging Face Trainer (rows with
    "hf_trainer": float32 and bf16); a figure a row does not have is "-"."""
    lines = ["| run | machine | memtune tok/s | PyTorch tok/s | speed | Trainer tok/s | vs Trainer | memtune RSS | "
             "PyTorch RSS | memory | Trainer RSS | vs Trainer | memtune's kernels |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for row in r["rows"]:
            mt = row["memtune"]
            cells = []
            for other in (row.get("reference"), row.get("hf_trainer")):
                cells.append(("-", "-", "-", "-") if other is None else (
                    f"{other['tokens_per_s']:.0f}", f"{mt['tokens_per_s'] / other['tokens_per_s']:.2f}x",
                    mib(other["peak_rss_bytes"]), f"{mt['peak_rss_bytes'] / other['peak_rss_bytes']:.3f}x"))
            (pt_tok, pt_speed, pt_rss, pt_mem), (hf_tok, hf_speed, hf_rss, hf_mem) = cells
            lines.append(f"| {row['run']} | {machine_text(r)} | {mt['tokens_per_s']:.0f} | {pt_tok} | {pt_speed} | "
                         f"{hf_tok} | {hf_speed} | {mib(mt['peak_rss_bytes'])} | {pt_rss} | {pt_mem} | {hf_rss} | "
                         f"{hf_mem} | {kernels_text(mt.get('products'), ('layers', 'head_forward'))} |")
    return lines


def table_eval(results):
    """memtune eval against the PyTorch reference's Trainer-style loop and against Trainer.evaluate at
    several eval-set sizes (full logits to compute_metrics, argmax ids, batch_eval_metrics), with
    memtune.Trainer running the argmax mode's functions unchanged, then the peak's growth."""
    def cell(x):
        if x is None:
            return "-"
        return "failed" if "failed" in x else f"{mib(x['peak_rss_bytes'])}, {x['seconds']:.1f} s"

    def per_sequence(b):
        return "-" if b is None else f"{b / 2**20:+.1f} MiB"

    lines = ["| run | machine | against | memtune eval | full logits kept | argmax kept | batch_eval_metrics | "
             "memtune.Trainer |", "|---|---|---|---:|---:|---:|---:|---:|"]
    growth = []
    for r in results:
        for row in r["rows"]:
            if "growth_bytes_per_sequence" in row:
                growth.append((r, row))
                continue
            against, other = (("PyTorch reference", row["reference"]) if "reference" in row
                              else ("HF Trainer.evaluate", row["hf_trainer"]))
            lines.append(f"| {row['run']} | {machine_text(r)} | {against} | {cell(row['memtune'])} | "
                         f"{cell(other['full'])} | {cell(other['argmax'])} | {cell(other.get('batch'))} | "
                         f"{cell(row.get('memtune_trainer'))} |")
    if growth:
        lines += ["", "| peak RSS growth per added sequence | machine | memtune eval | Trainer, full logits | "
                  "Trainer, argmax | Trainer, batch_eval_metrics | memtune.Trainer |",
                  "|---|---|---:|---:|---:|---:|---:|"]
        for r, row in growth:
            g = row["growth_bytes_per_sequence"]
            lines.append(f"| {row['run'].split(', ', 1)[-1]} sequences | {machine_text(r)} | "
                         f"{per_sequence(g['memtune'])} | {per_sequence(g['hf_trainer_full'])} | "
                         f"{per_sequence(g['hf_trainer_argmax'])} | {per_sequence(g.get('hf_trainer_batch'))} | "
                         f"{per_sequence(g.get('memtune_trainer'))} |")
    return lines


def table_generate(results):
    lines = ["| dtype | machine | read GB/s | decode limit tok/s | batch-1 decode tok/s | of limit | batch-8 decode "
             "tok/s | batch-8 / batch-1 | prefill tok/s | prefill GFLOP/s | of sgemm ceiling | prefill's kernels |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    llama_cpp = []
    for r in results:
        for row in r["rows"]:
            if row.get("engine") == "llama.cpp":
                llama_cpp.append((r, row))
                continue
            d = row["decode_tokens_per_s"]
            b1, b8 = d.get("1", 0.0), d.get("8", 0.0)
            lines.append(f"| {row['torch_dtype']} | {machine_text(r)} | {row['memory_read_gb_per_s']:.1f} | "
                         f"{row['decode_limit_tokens_per_s']:.1f} | {b1:.1f} | "
                         f"{b1 / row['decode_limit_tokens_per_s']:.0%} | {b8:.1f} | {b8 / b1:.2f}x | "
                         f"{row['prefill_tokens_per_s']:.1f} | {row['prefill_gflops']:.1f} | "
                         f"{row['prefill_gflops'] / row['sgemm_ceiling_gflops']:.0%} | "
                         f"{kernels_text(row.get('products'), ('layers', 'prefill'))} |")
    if llama_cpp:  # the same weights in llama.cpp, measured in the same run: memtune's rate over its
        lines += ["", "| memtune | llama.cpp (same weights, same run) | machine | prefill tok/s | vs llama.cpp | "
                  "batch-1 decode tok/s | vs llama.cpp |", "|---|---|---|---:|---:|---:|---:|"]
        pairs = {"f16": ["bfloat16"], "q8_0": ["gptq-int8, int8 activations", "gptq-int8, bfloat16 products"],
                 "q4_0": ["gptq-int4, int8 activations", "gptq-int4, bfloat16 products",
                          "gptq-int4, 8-bit head, int8 activations", "gptq-int4, 8-bit head, bfloat16 products",
                          "gptq-int4, 4-bit head, int8 activations", "gptq-int4, 4-bit head, bfloat16 products"]}
        for r, ref in llama_cpp:
            paired = [row for row in r["rows"] if row.get("torch_dtype") in pairs.get(ref["type"], [])]
            if not paired:  # a renamed label would otherwise drop the comparison without a word
                sys.exit(f"bench_results: no memtune row of the run ({machine_text(r)}) pairs with llama.cpp's "
                         f"{ref['type']} (expected a torch_dtype in {pairs.get(ref['type'], [])})")
            for row in paired:
                b1 = row["decode_tokens_per_s"].get("1", 0.0)
                lines.append(f"| {row['torch_dtype']} | {ref['type']}: {ref['prefill_tokens_per_s']:.1f} / "
                             f"{ref['decode_tokens_per_s']:.1f} | {machine_text(r)} | "
                             f"{row['prefill_tokens_per_s']:.1f} | "
                             f"{row['prefill_tokens_per_s'] / ref['prefill_tokens_per_s']:.2f}x | {b1:.1f} | "
                             f"{b1 / ref['decode_tokens_per_s']:.2f}x |")
    return lines


def table_serve(results):
    lines = ["| concurrency | machine | requests | generated tok/s | vs concurrency 1 | TTFT p50 | TTFT p99 | "
             "inter-token p50 | inter-token p99 | p99 vs concurrency 1 |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        one = next(row for row in r["rows"] if row["concurrency"] == 1)
        for row in r["rows"]:
            lines.append(f"| {row['concurrency']} | {machine_text(r)} | {row['requests']} | "
                         f"{row['tokens_per_s']:.1f} | {row['tokens_per_s'] / one['tokens_per_s']:.2f}x | "
                         f"{row['ttft_p50_s'] * 1e3:.0f} ms | {row['ttft_p99_s'] * 1e3:.0f} ms | "
                         f"{row['itl_p50_s'] * 1e3:.0f} ms | {row['itl_p99_s'] * 1e3:.0f} ms | "
                         f"{row['itl_p99_s'] / one['itl_p99_s']:.2f}x |")
    return lines


def table_quantize(results):
    lines = ["| model | machine | held-out perplexity | vs float32 | with float32 activations | "
             "int8 activations vs float32 ones | packed head vs 16-bit | file |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        base = next(row for row in r["rows"] if row["model"] == "float32")
        for row in r["rows"]:
            floats = row.get("perplexity_float_activations")
            with_floats = "-" if floats is None else f"{floats:.3f}"
            moved = "-" if floats is None else f"{row['int8_activations_vs_float']:+.3%}"
            head = row.get("packed_head_vs_16bit")
            head = "-" if head is None else f"{head:+.3%}"
            lines.append(f"| {row['model']} | {machine_text(r)} | {row['perplexity']:.3f} | "
                         f"{row['perplexity'] / base['perplexity'] - 1:+.2%} | {with_floats} | {moved} | {head} | "
                         f"{mib(row['file_bytes'])} |")
    lines += ["", "| preset | float16 weights | int8 (GPTQ, group 128) | int4 (GPTQ, group 128) |",
              "|---|---:|---:|---:|"]
    r = results[-1]
    for preset in dict.fromkeys(s["preset"] for s in r["settings"]["sizes"]):
        size = {s["quantization"]: s["weights_bytes"] for s in r["settings"]["sizes"] if s["preset"] == preset}
        lines.append(f"| {preset} | {size['float16'] / 2**30:.2f} GiB | {size['gptq-int8'] / 2**30:.2f} GiB | "
                     f"{size['gptq-int4'] / 2**30:.2f} GiB |")
    return lines


def table_moe(results):
    """A mixture-of-experts model's generation, memtune against llama.cpp on the same weights."""
    lines = ["| run | machine | memtune prefill tok/s | llama.cpp prefill tok/s | vs llama.cpp | memtune batch-1 "
             "decode tok/s | llama.cpp decode tok/s | vs llama.cpp | memtune's kernels |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for row in r["rows"]:
            mt, ll = row["memtune"], row["llama_cpp"]
            decode = mt["decode_tokens_per_s"].get("1", 0.0)
            lines.append(f"| {row['run']} | {machine_text(r)} | {mt['prefill_tokens_per_s']:.1f} | "
                         f"{ll['prefill_tokens_per_s']:.1f} | {mt['prefill_tokens_per_s'] / ll['prefill_tokens_per_s']:.2f}x | "
                         f"{decode:.1f} | {ll['decode_tokens_per_s']:.1f} | {decode / ll['decode_tokens_per_s']:.2f}x | "
                         f"{kernels_text(mt.get('products'), ('layers', 'prefill'))} |")
    return lines


def table_python_train(results):
    """The same training through `memtune train` and through memtune.Trainer (scripts/bench-python.sh)."""
    lines = ["| run | machine | CLI tokens/s | memtune.Trainer tokens/s | Python / CLI | largest loss difference |",
             "|---|---|---:|---:|---:|---:|"]
    for r in results:
        for row in r["rows"]:
            lines.append(f"| {row['run']} | {machine_text(r)} | {row['memtune_cli']['tokens_per_s']:.1f} | "
                         f"{row['memtune_python']['tokens_per_s']:.1f} | {row['ratio_python_to_cli']:.3f}x | "
                         f"{row['largest_loss_difference']:.1e} |")
    return lines


TABLES = {"memory": table_memory, "step": table_speed, "train": table_train, "eval": table_eval, "moe": table_moe,
          "generate": table_generate, "serve": table_serve, "quantize": table_quantize,
          "python_train": table_python_train}


def tables():
    newest = {}  # (name, machine tag) -> result, the newest per machine
    for path in sorted(glob.glob(str(RESULTS / "*.json"))):
        r = json.loads(pathlib.Path(path).read_text())
        key = (r["benchmark"], r["machine"]["cpu"], r["machine"]["cores"])
        if key not in newest or r["date"] > newest[key]["date"]:
            newest[key] = r
    for doc in (ROOT / "README.md", ROOT / "docs" / "benchmarks.md"):
        text = doc.read_text()

        def fill(match):
            name = match.group(1)
            results = sorted((r for (n, *_), r in newest.items() if n == name), key=lambda r: r["machine"]["cpu"])
            if not results or name not in TABLES:
                return match.group(0)
            body = "\n".join(TABLES[name](results))
            return f"<!-- bench:{name} -->\n{body}\n<!-- /bench:{name} -->"

        updated = re.sub(r"<!-- bench:([a-z_]+) -->.*?<!-- /bench:\1 -->", fill, text, flags=re.S)
        if updated != text:
            doc.write_text(updated)
            print(f"updated {doc.relative_to(ROOT)}")


def main():
    if len(sys.argv) >= 2 and sys.argv[1] == "tables":
        tables()
    elif len(sys.argv) == 5 and sys.argv[1] == "record":
        record(sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4]))
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
