"""GPTQ checkpoints written by `memtune quantize`, loaded by transformers with optimum and
auto-gptq on the CPU, give memtune's logits.

    PY tests/interop/hf_gptq_test.py --memtune BIN --workdir DIR

For Qwen2.5, Qwen3, Llama 3, Qwen3-MoE and Qwen2-MoE (the tiny presets with every projection a
multiple of 32 wide,
which auto-gptq's CPU layers need, as every real Qwen and Llama shape is), three files each:
round-to-nearest 4-bit and 8-bit with groups of 32, and GPTQ 4-bit with act-order (desc_act, a
g_idx) calibrated on a few lines. Each loads with AutoModelForCausalLM.from_pretrained(device_map
"cpu") with no missing or unexpected tensor, exactly the layers the file packs become auto-gptq's
quantized layers (the packed codes are what computes, nothing was dequantized on the way; a
mixture of experts' router stays a float layer, as in Qwen's GPTQ MoE checkpoints, because the
file's modules_in_block_to_quantize names every expert's projections and not it), and its logits
equal `memtune dump --quantized_activations float` (both dequantize the same codes and compute in
float32) within 1e-4 of the largest logit. A NaN fails (tests/support/numeric.py).

Not covered, because these loaders do not read it: a packed LM head (`quantize --lm_head_bits`),
which transformers reports as unused and replaces by a new random head.
"""

import importlib.metadata
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "support"))
import memtune_cli  # noqa: E402
from byte_tokenizer import write_tokenizer  # noqa: E402
from hf_checks import dtype_argument  # noqa: E402
from numeric import assert_close, check  # noqa: E402

import auto_gptq  # noqa: E402
import optimum  # noqa: E402,F401
import transformers  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

LOGIT_RTOL = 1e-4
FAMILIES = {"qwen2": ["--preset", "tiny"], "qwen3": ["--preset", "tiny-qwen3", "--set", "head_dim=32"],
            "llama": ["--preset", "tiny-llama"],
            # Mixtures of experts: every expert's projections packed, the router (and Qwen2-MoE's
            # shared-expert gate) as stored, which the file says in modules_in_block_to_quantize.
            "qwen3_moe": ["--preset", "tiny-qwen3-moe", "--set", "head_dim=32", "--set", "moe_intermediate_size=64"],
            "qwen2_moe": ["--preset", "tiny-qwen2-moe", "--set", "moe_intermediate_size=64",
                          "--set", "shared_expert_intermediate_size=64"]}
VARIANTS = {"rtn4": ["--bits", 4, "--group_size", 32], "rtn8": ["--bits", 8, "--group_size", 32],
            "gptq4_act_order": ["--bits", 4, "--group_size", 32, "--method", "gptq", "--act_order",
                                "--num_samples", 8, "--max_length", 64]}
TEXTS = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs!",
         "sphinx of black quartz, judge my vow", "how vexingly quick daft zebras jump; 0123",
         "waltz, bad nymph, for quick jigs vex", "glib jocks quiz nymph to vex dwarf",
         "jackdaws love my big sphinx of quartz", "five boxing wizards jump quickly"]
IDS = [[116, 104, 101, 32, 113, 117, 105, 99, 107, 32, 98, 114, 111, 119, 110, 32, 102, 111, 120, 32],
       [112, 97, 99, 107, 32, 109, 121, 32, 98, 111, 120, 32, 119, 105, 116, 104, 32, 102, 105, 118]]


def run(args):
    return memtune_cli.run(args).stdout


def check_variant(memtune, workdir, base, name):
    out = os.path.join(workdir, name)
    variant = VARIANTS[name.split("/")[1]]
    calibration = ["--calibration_file", os.path.join(workdir, "calibration.jsonl")] if "gptq" in variant else []
    run([memtune, "quantize", "--model", base, "--out", out, *variant, *calibration])
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    check(qc["quant_method"] == "gptq", f"{out}: quantization_config {qc}")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, device_map="cpu",
                                                                    **dtype_argument(torch.float32),
                                                                    output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        check(not info[key], lambda: f"{out}: transformers reports {key} {info[key]}")
    quantized = [n for n, m in model.named_modules() if type(m).__module__.startswith("auto_gptq.nn_modules.qlinear")]
    with open(os.path.join(out, "model.safetensors"), "rb") as f:  # the packed layers the file holds
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    packed = sorted(k[: -len(".qweight")] for k in header if k.endswith(".qweight"))
    check(sorted(quantized) == packed and len(packed) >= 7 * model.config.num_hidden_layers,
          lambda: f"{out}: auto-gptq layers {quantized}, the file packs {packed}")
    inp = os.path.join(workdir, "ids.json")
    with open(inp, "w") as f:
        json.dump({"input_ids": IDS}, f)
    dump = os.path.join(workdir, "dump.safetensors")
    run([memtune, "dump", "--model", out, "--input", inp, "--out", dump, "--quantized_activations", "float"])
    with torch.no_grad():
        theirs = model(torch.tensor(IDS)).logits.float().numpy()
    d = assert_close(load_file(dump)["logits"], theirs, rtol=LOGIT_RTOL,
                     what=f"{name}: logits, memtune against transformers + auto-gptq")
    return d


def main():
    a = memtune_cli.test_arguments()
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    with open(os.path.join(a.workdir, "calibration.jsonl"), "w") as f:
        for t in TEXTS:
            f.write(json.dumps({"text": t}) + "\n")
    print(f"transformers {transformers.__version__}, optimum {importlib.metadata.version('optimum')}, "
          f"auto-gptq {auto_gptq.__version__}, torch {torch.__version__}")
    failures = []
    for family, preset in FAMILIES.items():
        base = os.path.join(a.workdir, family, "base")
        run([a.memtune, "init-model", *preset, "--set", "intermediate_size=192", "--set", "initializer_range=0.1",
             "--out", base])
        write_tokenizer(base)
        for variant in VARIANTS:
            name = f"{family}/{variant}"
            try:
                d = check_variant(a.memtune, a.workdir, base, name)
                print(f"ok    {name}: worst |memtune - transformers| {d.worst:.3g} of max |logit| {d.scale:.3g}")
            except Exception as e:
                failures.append(name)
                print(f"FAIL  {name}: {type(e).__name__}: {e}")
    print(f"{len(FAMILIES) * len(VARIANTS) - len(failures)} passed, {len(failures)} failed")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
