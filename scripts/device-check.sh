#!/usr/bin/env bash
# The vulkan backend on a GPU, in one run, in stages under a total budget (8 minutes by default,
# MEMTUNE_CHECK_BUDGET_S). Each stage writes its part of out/device-check/device-check.json before
# the next starts, so a late failure or the budget running out keeps the earlier figures:
#   devices   `memtune devices`: the device --backend vulkan takes, which driver manifest the
#             Vulkan loader was given (below), and the device's peaks (below);
#   ops       the vulkan op table (VulkanOps.*, BackendOps.*) on that device;
#   e2e       the end-to-end test on it (every command on vulkan against cpu, resume bit-identical);
#   model     a Qwen2.5-0.5B-shaped bfloat16 model (random weights), full fine-tuning, batch 4 x 512
#             as scripts/bench-train.sh runs it, trained twice from the same weights on the same
#             data: `--bf16` (float32 arithmetic over bfloat16 weights: the register-tiled
#             gemm.comp) and `--fp16` (float16 weights; mixed precision on the cooperative
#             matrices, gemm_coopmat.comp, where `memtune devices --json`'s kernels say the device
#             has them). Each run's tokens/s, MFU, kernel (its arithmetic: line and the devices
#             JSON's kernel for it), waits, dispatches and barriers per step are written as soon as
#             it ends, then their ratio (fp16_against_bf16); only then one profiled step of each
#             (MEMTUNE_VULKAN_PROFILE: device seconds per shader, and fp16_against_bf16_profiled,
#             the step's and its products' device seconds, skipped fp16 steps or not), prefill
#             and batch-1 / batch-8 decode against the HBM bound;
#   trainer   where python3 imports transformers and torch sees CUDA: Hugging Face Trainer on the
#             same model, batch and steps (bf16 autocast, SDPA attention, fused AdamW; full and
#             PEFT LoRA; bench/hf_trainer_bench.py): tokens/s and torch.cuda.max_memory_allocated.
# The exit status is 0 only if every stage that ran passed.
#
# Peaks: MFU is against the dense bfloat16 tensor-core peak (float16's is the same on these
# parts) and decoding against the HBM bandwidth, MEMTUNE_PEAK_FLOPS and MEMTUNE_HBM_BYTES_PER_S
# when given, else the figures of the device's name in the table of stage_devices (NVIDIA's
# datasheets: H100 SXM / PCIe / NVL, H200 SXM / NVL). The JSON's "peaks" says which were used and
# where they came from; for a device that is in no row and not given, MFU and the ratio to the
# HBM bound are left out and "peaks" says so.
#
# Budget: each stage has a share of the budget (below, for the default 480 s; scaled with
# MEMTUNE_CHECK_BUDGET_S) that the stages before it cannot take: a stage may run until what is
# left of the budget is the shares of the stages after it. What a stage leaves unused goes to the
# next. Estimated times on an H100 (not yet measured there; the JSON's stage_seconds will say):
#   stage     estimate  share  what the estimate is made of
#   devices       5 s    30 s  a few `memtune devices --json` (one per driver manifest tried)
#   ops          40 s   120 s  the op table (VulkanOps.*, BackendOps.*)
#   e2e          30 s    75 s  one process per command on cpu and vulkan, each starting the device
#   model        95 s   165 s  init-model and 1 GB of bfloat16 weights, 10 s; each training run
#                              15 s (process start, loading and pipelines 8 s, then steps of ~6.1
#                              TFLOP: --bf16 6 at an assumed 15-25 TFLOP/s of float32 FMAs, 0.3-0.4
#                              s a step; --fp16 10 on the matrix units, 0.1-0.2 s a step); the two
#                              one-step profiles 25 s (every dispatch alone); generation 30 s
#                              (two processes, 512-token prompts, 128 tokens each)
#   trainer      50 s    90 s  per run (full, LoRA): importing torch and transformers and CUDA's
#                              start 10 s, the tokenization check, loading and 6 steps 15 s
#   total       220 s   480 s  (the GPU machine's own start and the bundle's transfer come on top)
#
# The GPU machine may have no compiler, no -dev packages, no Vulkan loader and no network:
#   scripts/device-check.sh --bundle FILE.tar.gz [BUILD_DIR]
#       (here) one compressed archive of at most 48 MiB: memtune and memtune_tests (of build/,
#       built first, or of BUILD_DIR as they are), every shared library they load but glibc's,
#       Debian's Vulkan loader and glvnd's libGLdispatch (NVIDIA's Vulkan driver loads it), and the
#       Qwen2.5 tokenizer. The binaries find their libraries through $ORIGIN (patchelf), and the
#       tests take the memtune binary from $MEMTUNE_BINARY: nothing refers to this machine's paths.
#       The C++ runtime (libstdc++, libgcc_s) is kept apart, in lib/cxx-runtime/: the bundle's
#       `library-path` (scripts/bundle-library-path.sh) prints the library path for memtune's
#       processes, with that runtime only where the machine's own is missing or older, since a
#       newer machine's Vulkan driver can need its newer one.
#   scripts/device-check.sh --from FILE.tar.gz      (there, in a copy of this tree) unpacks it under
#       out/device-check/memtune-bundle and runs the stages with it.
# Without --from, build/ is built and used. Library paths and the driver manifest are set for
# memtune's processes only, never for python3 (whose PyTorch brings its own libraries). When the
# loader finds no device by itself, the first manifest that gives one is taken from
# $MEMTUNE_VULKAN_DRIVER_DIRS (default: /usr/local/nvidia/share/vulkan/icd.d, then
# /usr/local/share/vulkan/icd.d, /usr/share/vulkan/icd.d, /etc/vulkan/icd.d), a GPU before a CPU.
# MEMTUNE_VULKAN_DEVICE picks another device. The model stage's settings: MEMTUNE_CHECK_PRESET
# (qwen2.5-0.5b), MEMTUNE_CHECK_BATCH (4), MEMTUNE_CHECK_SEQ (512: max_length, and the examples'
# length), MEMTUNE_CHECK_STEPS (6, the first a warm-up; the trainer stage's too),
# MEMTUNE_CHECK_FP16_STEPS (the --fp16 run's: 4 more), MEMTUNE_CHECK_NEW_TOKENS (128). Small
# settings for a smoke run on lavapipe:
#   MEMTUNE_CHECK_PRESET=tiny MEMTUNE_CHECK_BATCH=1 MEMTUNE_CHECK_STEPS=2 MEMTUNE_CHECK_FP16_STEPS=2
#   MEMTUNE_CHECK_NEW_TOKENS=4 MEMTUNE_CHECK_ALLOW_CPU=1 (scripts/device-check-bare-root.sh runs
#   exactly that in a bare root, scripts/coopmat-root.sh check in a Debian sid root whose
#   lavapipe has cooperative matrices).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
mode=run archive=""
case "${1:-}" in
  --bundle) mode=bundle archive="${2:?--bundle needs an archive name (FILE.tar.gz)}" build_dir="${3:-}" ;;
  --from) archive="${2:?--from needs the archive --bundle made}" ;;
  "") ;;
  *) echo "device-check: unknown argument '$1' (expected --bundle FILE.tar.gz [BUILD_DIR] or --from FILE.tar.gz)" >&2; exit 1 ;;
esac

if [[ "$mode" == bundle ]]; then
  command -v patchelf > /dev/null || { echo "device-check: --bundle needs patchelf (scripts/install-deps.sh)" >&2; exit 1; }
  if [[ -z "$build_dir" ]]; then
    build_dir="$root/build"
    "$root/scripts/build.sh" "$build_dir" > /dev/null
  fi
  for bin in memtune memtune_tests; do
    [[ -x "$build_dir/$bin" ]] || { echo "device-check: --bundle: $build_dir/$bin is missing (build it first)" >&2; exit 1; }
  done
  stage="$(mktemp -d)"
  trap 'rm -rf "$stage"' EXIT
  b="$stage/memtune-bundle"
  mkdir -p "$b/bin" "$b/lib/cxx-runtime" "$b/tokenizer"
  cp "$build_dir/memtune" "$build_dir/memtune_tests" "$b/bin/"
  cp "$root/scripts/bundle-library-path.sh" "$b/library-path"
  libs=()
  for bin in "$build_dir/memtune" "$build_dir/memtune_tests"; do
    while read -r lib; do libs+=("$lib"); done < <(ldd "$bin" | awk '/=> \// {print $3}')
  done
  # Debian's Vulkan loader (the GPU machine may have none) and glvnd's dispatch library.
  for soname in libvulkan.so.1 libGLdispatch.so.0; do
    # (awk reads to the end: an early exit would leave ldconfig a broken pipe, fatal under pipefail)
    path="$(ldconfig -p | awk -v n="$soname" '!found && $1 == n && /x86-64/ {print $NF; found = 1}')"
    [[ -n "$path" ]] || { echo "device-check: $soname is not installed (scripts/install-deps.sh)" >&2; exit 1; }
    libs+=("$path")
  done
  for lib in "${libs[@]}"; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*|libresolv.so*) ;;  # glibc's
      libstdc++.so*|libgcc_s.so*) cp -L "$lib" "$b/lib/cxx-runtime/$(basename "$lib")" ;;
      *) cp -L "$lib" "$b/lib/$(basename "$lib")" ;;
    esac
  done
  # Every binary and library looks in the bundle's lib/ first, wherever the bundle is unpacked;
  # none looks in lib/cxx-runtime/ (library-path adds it where the machine needs it).
  for f in "$b/bin/"*; do patchelf --set-rpath '$ORIGIN/../lib' "$f"; done
  for f in "$b/lib/"*.so* "$b/lib/cxx-runtime/"*; do patchelf --set-rpath '$ORIGIN' "$f"; done
  strip --strip-unneeded "$b/bin/"* "$b/lib/"*.so* "$b/lib/cxx-runtime/"* 2> /dev/null || true
  cp "${MEMTUNE_TOKENIZER_DIR:-$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)}"/tokenizer*.json "$b/tokenizer/"
  git -C "$root" rev-parse --short=10 HEAD > "$b/COMMIT" 2> /dev/null || echo unknown > "$b/COMMIT"
  mkdir -p "$(dirname "$archive")"
  tar -C "$stage" -czf "$archive.tmp" memtune-bundle
  size=$(stat -c %s "$archive.tmp")
  if ((size > 48 * 1024 * 1024)); then
    rm -f "$archive.tmp"
    echo "device-check: the bundle is $((size / 1048576)) MiB, over the 48 MiB that can be carried" >&2
    exit 1
  fi
  mv "$archive.tmp" "$archive"
  echo "device-check: wrote $archive ($((size / 1048576)) MiB, $(find "$b/lib" -type f | wc -l) libraries)"
  exit 0
fi

preset="${MEMTUNE_CHECK_PRESET:-qwen2.5-0.5b}" batch="${MEMTUNE_CHECK_BATCH:-4}" seq="${MEMTUNE_CHECK_SEQ:-512}"
steps="${MEMTUNE_CHECK_STEPS:-6}" new_tokens="${MEMTUNE_CHECK_NEW_TOKENS:-128}"
budget="${MEMTUNE_CHECK_BUDGET_S:-480}"
[[ "$steps" =~ ^[1-9][0-9]*$ ]] && fp16_steps="${MEMTUNE_CHECK_FP16_STEPS:-$((steps + 4))}"
for setting in batch:"$batch" seq:"$seq" steps:"$steps" fp16_steps:"${fp16_steps:-}" new_tokens:"$new_tokens" \
               budget:"$budget"; do
  [[ "${setting#*:}" =~ ^[1-9][0-9]*$ ]] ||
    { echo "device-check: ${setting%%:*} must be a positive integer, not '${setting#*:}' (MEMTUNE_CHECK_*)" >&2; exit 1; }
done
((seq >= 16)) || { echo "device-check: MEMTUNE_CHECK_SEQ must be at least 16" >&2; exit 1; }
for peak in MEMTUNE_PEAK_FLOPS MEMTUNE_HBM_BYTES_PER_S; do
  [[ -z "${!peak:-}" || "${!peak}" =~ ^[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?$ && ! "${!peak}" =~ ^[0.]+([eE]|$) ]] ||
    { echo "device-check: $peak=${!peak} is not a positive number (such as 989.5e12)" >&2; exit 1; }
done
out="$root/out/device-check"
rm -rf "$out"
mkdir -p "$out"
if [[ -n "$archive" ]]; then
  tar -C "$out" -xzf "$archive"
  bundle="$out/memtune-bundle"
  memtune_bin="$bundle/bin/memtune" tests_bin="$bundle/bin/memtune_tests" tokenizer="$bundle/tokenizer"
else
  "$root/scripts/build.sh" "$root/build" > /dev/null
  memtune_bin="$root/build/memtune" tests_bin="$root/build/memtune_tests"
  tokenizer="${MEMTUNE_TOKENIZER_DIR:-$("$root/scripts/prepare-tokenizer.sh" | tail -n 1)}"
fi
started=$SECONDS
driver_files="${VK_DRIVER_FILES:-${VK_ICD_FILENAMES:-}}"

# Each stage's share of the default 480 s budget (the header's table), scaled to the budget.
stages=(devices ops e2e model trainer)
declare -A share=([devices]=30 [ops]=120 [e2e]=75 [model]=165 [trainer]=90)
for s in "${stages[@]}"; do share[$s]=$((share[$s] * budget / 480)); done

# memtune's processes (and only they) run with the bundle's libraries first (what the driver
# loads, libGLdispatch, is found there too: a RUNPATH does not reach a dlopen'ed driver's own
# dependencies), the bundle's C++ runtime where this machine's is missing or older (the bundle's
# library-path says which), and the driver manifest that was found.
library_path="${LD_LIBRARY_PATH:-}"
if [[ -n "${bundle:-}" ]]; then
  library_path="$("$bundle/library-path")${library_path:+:$library_path}"
fi
with_driver() {
  local vars=(MEMTUNE_BINARY="$memtune_bin" MEMTUNE_TOKENIZER_DIR="$tokenizer" LD_LIBRARY_PATH="$library_path")
  [[ -n "$driver_files" ]] && vars+=(VK_DRIVER_FILES="$driver_files" VK_ICD_FILENAMES="$driver_files")
  env "${vars[@]}" "$@"
}
mt() { with_driver "$memtune_bin" "$@"; }
left() { echo $((budget - (SECONDS - started))); }
# Seconds left to the running stage (STAGE_END, set by run_stage), at least 1: what `timeout`
# takes (its 0 would mean no limit).
stage_left() {
  local n=$((STAGE_END - SECONDS))
  ((n > 0)) || n=1
  echo "$n"
}

# The JSON so far: `record KEY JSON` sets one key and rewrites the file; KEY may name a key
# inside another (model.train_full_bf16).
json="$out/device-check.json"
echo '{}' > "$json"
record() {
  python3 - "$json" "$1" "$2" <<'PY'
import json, sys
path, key, value = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
doc = json.load(open(path))
*parents, last = key.split(".")
node = doc
for k in parents:
    node = node.setdefault(k, {})
node[last] = value
json.dump(doc, open(path + ".tmp", "w"), indent=2)
PY
  mv "$json.tmp" "$json"
}
record budget "$(for s in "${stages[@]}"; do echo "$s ${share[$s]}"; done | python3 -c 'import json, sys
print(json.dumps({"seconds": int(sys.argv[1]), "stage_shares_s": {s: int(n) for s, n in map(str.split, sys.stdin)}}))' "$budget")"
failed=()
# run_stage NAME FUNCTION: the stage until what is left of the budget is the shares of the stages
# after it; its failure is recorded and the next stage still runs.
run_stage() {
  local name="$1" rc=0 later=0 after=0 s limit t0=$SECONDS
  for s in "${stages[@]}"; do
    if ((after)); then later=$((later + share[$s])); fi
    if [[ "$s" == "$name" ]]; then after=1; fi
  done
  limit=$(($(left) - later))
  echo "== $name ($limit s of the budget left for it)"
  if ((limit < 10)); then
    record "$name" '{"status": "skipped: the budget ran out"}'
    failed+=("$name")
    return
  fi
  # A subshell with -e of its own (a function called from `||` would run with -e ignored).
  set +e
  (set -e; STAGE_END=$((SECONDS + limit)); "$2")
  rc=$?
  set -e
  if ((rc != 0)); then
    failed+=("$name")
    local why="failed (exit $rc)"
    ((rc == 124)) && why="failed (exit 124: out of budget)"
    record "${name}_status" "\"$why\""
  fi
  record "stage_seconds.$name" "$((SECONDS - t0))"
  record seconds "$((SECONDS - started))"
}

# --- devices: which device, which driver, its peaks ---------------------------------------------
devices_json() { with_driver timeout 20 "$memtune_bin" devices --json 2> /dev/null; }
# 0 when the current driver setting lists a device (a GPU unless MEMTUNE_CHECK_ALLOW_CPU=1).
usable_device() {
  local d
  d="$(devices_json)" || return 1
  python3 - "$d" <<'PY'
import json, os, sys
d = json.loads(sys.argv[1])
chosen = d.get("backend_vulkan_device")
if chosen is None:
    sys.exit(1)
device = next(x for x in d["devices"] if x["index"] == chosen)
sys.exit(0 if "CPU" not in device["type"] or os.environ.get("MEMTUNE_CHECK_ALLOW_CPU") == "1" else 1)
PY
}
# peaks DEVICES_JSON: the peaks the model stage measures against, and where each came from.
peaks() {
  python3 - "$1" <<'PY'
import json, os, re, sys
# Dense figures from NVIDIA's datasheets ("NVIDIA H100 Tensor Core GPU": SXM, NVL and PCIe
# columns; "NVIDIA H200 Tensor Core GPU": SXM and NVL). The datasheets give the tensor cores'
# BF16 (and FP16, the same) figure with sparsity: dense is half of it (H100 SXM 1,979 -> 989.5
# TFLOPS, NVL 1,671 -> 835.5, PCIe 1,513 -> 756.5; H200 SXM 1,979 -> 989.5, NVL 1,671 -> 835.5).
# FP32 is the CUDA cores' figure (67, 60, 51; 67, 60 TFLOPS), what the float32 arithmetic of the
# register-tiled kernels can reach at most; the bandwidth is the GPU memory bandwidth (3.35, 3.9,
# 2.0; 4.8, 4.8 TB/s). The first row whose pattern is found in the Vulkan device name is taken
# (NVIDIA's driver names the H100 SXM "NVIDIA H100 80GB HBM3").
#   pattern                      part         bf16 dense  float32  HBM bytes/s
TABLE = [
    (r"\bH200 NVL\b",            "H200 NVL",  835.5e12,   60e12,   4.8e12),
    (r"\bH200\b",                "H200 SXM",  989.5e12,   67e12,   4.8e12),
    (r"\bH100 NVL\b",            "H100 NVL",  835.5e12,   60e12,   3.9e12),
    (r"\bH100 PCIe\b",           "H100 PCIe", 756.5e12,   51e12,   2.0e12),
    (r"\bH100 (SXM|80GB HBM3)",  "H100 SXM",  989.5e12,   67e12,   3.35e12),
]
d = json.loads(sys.argv[1])
chosen = d.get("backend_vulkan_device")
name = next((x["name"] for x in d.get("devices", []) if x["index"] == chosen), None)
row = next((r for r in TABLE if name and re.search(r[0], name)), None)
where = f"from the device name {name} ({row[1]} in NVIDIA's datasheet)" if row else None
peaks = {"device": name}
for key, column, variable in (("bf16_tensor_flops", 2, "MEMTUNE_PEAK_FLOPS"), ("float32_flops", 3, None),
                              ("hbm_bytes_per_s", 4, "MEMTUNE_HBM_BYTES_PER_S")):
    given = os.environ.get(variable, "") if variable else ""  # checked at the start
    if given:
        peaks[key], peaks[key + "_from"] = float(given), f"given ({variable})"
    elif row:
        peaks[key], peaks[key + "_from"] = row[column], where + ("; dense: half its figure with sparsity"
                                                                 if key == "bf16_tensor_flops" else "")
    else:
        peaks[key] = None
        peaks[key + "_from"] = (f"none: the device name {name} is in no row of the table" +
                                (f" and {variable} is not set" if variable else ""))
print(json.dumps(peaks))
PY
}
stage_devices() {
  local how="the loader's own search"
  if [[ -n "$driver_files" ]]; then
    how="VK_DRIVER_FILES as given"
  elif ! usable_device; then
    how=""
    local dirs="${MEMTUNE_VULKAN_DRIVER_DIRS:-/usr/local/nvidia/share/vulkan/icd.d:/usr/local/share/vulkan/icd.d:/usr/share/vulkan/icd.d:/etc/vulkan/icd.d}"
    local IFS=: dir manifest
    for dir in $dirs; do
      for manifest in "$dir"/*.json; do
        [[ -f "$manifest" ]] || continue
        driver_files="$manifest"
        if usable_device; then how="found in $dir"; break 2; fi
        driver_files=""
      done
    done
    unset IFS
  fi
  local d
  d="$(devices_json)" || d='{}'
  mt devices || true
  record devices "$d"
  record driver "$(python3 -c 'import json,sys; print(json.dumps({"manifest": sys.argv[1] or None, "how": sys.argv[2] or None}))' \
    "$driver_files" "$how")"
  [[ -n "$how" ]] && usable_device || {
    echo "device-check: no usable Vulkan device (is the GPU driver's Vulkan manifest installed? looked in" \
         "${MEMTUNE_VULKAN_DRIVER_DIRS:-/usr/local/nvidia/share/vulkan/icd.d and the usual places})" >&2
    return 1
  }
  local shown="$driver_files"
  [[ -n "$shown" ]] || shown="the loader's own search"
  echo "driver: $shown ($how)"
  echo "$driver_files" > "$out/driver_files"  # for the stages after this one (this runs in a subshell)
  local p
  p="$(peaks "$d")"
  record peaks "$p"
  python3 -c 'import json, sys; p = json.loads(sys.argv[1])
for k in ("bf16_tensor_flops", "float32_flops", "hbm_bytes_per_s"): print("%s: %s (%s)" % (k, p[k], p[k + "_from"]))' "$p"
}

# --- ops and e2e: the test binary on the device ------------------------------------------------
gtest_stage() {
  local name="$1" filter="$2"
  local rc=0
  MEMTUNE_REQUIRE_ALL_TESTS=1 with_driver timeout "$(stage_left)" "$tests_bin" --gtest_filter="$filter" \
    > "$out/$name.log" 2>&1 || rc=$?
  grep -E '^\[  (PASSED|FAILED) ' "$out/$name.log" || true
  record "$name" "$(python3 - "$out/$name.log" "$rc" <<'PY'
import json, re, sys
text = open(sys.argv[1], errors="replace").read()
print(json.dumps({"exit": int(sys.argv[2]),
                  "passed": len(re.findall(r"^\[       OK \]", text, re.M)),
                  "failed": sorted(set(re.findall(r"^\[  FAILED  \] (\S+)", text, re.M)))}))
PY
)"
  return "$rc"
}
stage_ops() { gtest_stage ops 'VulkanOps.*:BackendOps.*'; }
stage_e2e() { gtest_stage e2e 'TrainCliTest.EveryCommandRunsOnVulkanAndAgreesWithCpu'; }

# --- model: a real shape, bfloat16 ------------------------------------------------------------
# model_figures KIND [VARIANT]: the model stage's figures of one kind, as JSON, from its runs'
# files and what device-check.json holds so far (devices, peaks, model).
model_figures() {
  python3 - "$1" "${2:-}" "$out" "$json" <<'PY'
import json, re, sys
kind, variant, out, doc_path = sys.argv[1:5]
doc = json.load(open(doc_path))
model, peaks = doc["model"], doc.get("peaks") or {}
devices = doc.get("devices") or {}
device = next((x for x in devices.get("devices", []) if x["index"] == devices.get("backend_vulkan_device")), {})
config = json.load(open(f"{out}/model/config.json"))
d, i, L, V = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
layer = d * d * 2 + d * kv * 2 + 3 * d * i
params = L * layer + V * d * (1 if config.get("tie_word_embeddings") else 2)
flops_per_token = 6 * (L * layer + V * d)  # forward + backward of every matmul, the head included
no_peak = "absent: no bfloat16 peak for this device (see peaks)"


def train():
    run, log_path = f"{out}/train-{variant}", f"{out}/train-{variant}.log"
    arithmetic = next((line[len("arithmetic: "):].strip() for line in open(log_path, errors="replace")
                       if line.startswith("arithmetic: ")), None)
    mixed = bool(arithmetic) and arithmetic.startswith("mixed precision")
    family = ({"fp16": "float16 products (--fp16)", "bf16": "bfloat16 products (--bf16)"}[variant] if mixed
              else "float32 products")
    # The first logged step is a warm-up, and so is one after a step fp16's loss scaling skipped
    # (its tokens/s would count the skipped step's time); with nothing else left, all are taken.
    logged, timed, skipped, warm, last_scale = [], [], 0, False, None
    for r in (json.loads(line) for line in open(f"{run}/log.jsonl") if line.strip()):
        if "skipped" in r:
            skipped, warm, last_scale = skipped + 1, False, r.get("next_loss_scale")
        elif "tokens_per_second" in r:
            logged.append(r)
            if warm:
                timed.append(r)
            warm = True
    timed = timed or logged
    memory = json.load(open(f"{run}/memory.json"))
    figures = {"batch": model["batch"], "seq": model["seq"], "timed_steps": len(timed), "skipped_steps": skipped,
               "arithmetic": arithmetic, "kernel": device.get("kernels", {}).get(family), "kernel_family": family,
               "loss_first_step": logged[0].get("loss") if logged else None}
    if timed:
        tokens_per_s = sum(r["tokens_per_second"] for r in timed) / len(timed)
        figures["tokens_per_s"] = tokens_per_s
        if peaks.get("bf16_tensor_flops"):
            figures["mfu"] = tokens_per_s * flops_per_token / peaks["bf16_tensor_flops"]
        else:
            figures["mfu"] = no_peak
        if not mixed and peaks.get("float32_flops"):
            figures["of_float32_peak"] = tokens_per_s * flops_per_token / peaks["float32_flops"]
        figures.update({"phase_seconds": {k: timed[-1].get(f"{k}_seconds") for k in ("forward", "loss", "backward")},
                        "phase_clock": timed[-1].get("phase_clock")})
    else:  # fp16: the loss scale backs off from 65536 by halving, a step skipped each time
        figures["tokens_per_s"] = (f"absent: all {skipped} steps skipped (non-finite gradients; the loss scale "
                                   f"backed off to {last_scale}): see fp16_against_bf16_profiled")
    figures.update({"plan_arena_bytes": memory["arena_bytes"], "device": memory.get("device"),
                    "device_work": memory.get("device_work")})
    return figures


def compare():
    bf16, fp16 = model.get("train_full_bf16") or {}, model.get("train_full_fp16") or {}
    if not all(isinstance(x.get("tokens_per_s"), float) for x in (bf16, fp16)):
        return "absent: a run failed or updated nothing (see train_full_bf16, train_full_fp16)"
    return {"tokens_per_s_ratio": fp16["tokens_per_s"] / bf16["tokens_per_s"],
            "fp16": {k: fp16[k] for k in ("tokens_per_s", "kernel", "arithmetic")},
            "bf16": {k: bf16[k] for k in ("tokens_per_s", "kernel", "arithmetic")}}


def profile():
    # Per shader: device seconds (timestamps around each dispatch, run alone), workgroups, and the
    # FLOPs and bytes each dispatch is designed for (src/backend/vulkan/geometry.cpp), the rates.
    shaders = {}
    for v in ("bf16", "fp16"):
        if f"profile_{v}_status" in model:  # failed: its figures stop where it did
            continue
        try:
            text = open(f"{out}/profile-{v}.log", errors="replace").read()
        except FileNotFoundError:
            continue
        shaders[v] = {m.group(1): {"seconds": float(m.group(2)), "dispatches": int(m.group(3)),
                                   "workgroups": int(m.group(4)), "gflop": float(m.group(5)), "gb": float(m.group(6)),
                                   "gflop_per_s": float(m.group(7)), "gb_per_s": float(m.group(8))}
                      for m in re.finditer(r"vulkan profile: (\S+)\s+(\S+) s in (\d+) dispatches, (\d+) workgroups, "
                                           r"(\S+) GFLOP, (\S+) GB: (\S+) GFLOP/s, (\S+) GB/s", text)}
    return shaders


def profiled():
    # The profiled step of each run by the device's timestamps: every dispatch, and the products
    # (gemm*, matvec: where the cooperative matrices are) alone. Skipped steps count here too.
    shaders = profile()
    if not ("bf16" in shaders and "fp16" in shaders):
        return "absent: a profiled run failed (see model)"
    figures = {}
    for v, by_shader in shaders.items():
        products = {k: x for k, x in by_shader.items() if k.startswith(("gemm", "matvec"))}
        seconds = sum(x["seconds"] for x in products.values())
        figures[v] = {"device_seconds": sum(x["seconds"] for x in by_shader.values()), "product_seconds": seconds,
                      "product_gflop_per_s": sum(x["gflop"] for x in products.values()) / seconds if seconds else None,
                      "product_shaders": sorted(products)}
    for key, of in (("step_speedup", "device_seconds"), ("product_speedup", "product_seconds")):
        figures[key] = figures["bf16"][of] / figures["fp16"][of] if figures["fp16"][of] else None
    return figures


def generate():
    gen = {b: json.load(open(f"{out}/generate{b}.json")) for b in (1, 8)}
    # Per prefill and decode step: the mean dispatches, barriers and host waits (generate{b}.json
    # has the rest of device_work).
    figures = {"batches": {f"batch{b}": {**{k: s.get(k) for k in ("prefill_tokens_per_second", "decode_tokens_per_second")},
                                         "device_work": {unit: {k: w[k]["mean"] for k in ("dispatches", "barriers", "waits")
                                                                if isinstance(w.get(k), dict)}
                                                         for unit, w in (s.get("device_work") or {}).items()
                                                         if isinstance(w, dict)}}
                           for b, s in gen.items()}}
    # Batch-1 decoding reads every weight once per token: 2 bytes each in bfloat16.
    if peaks.get("hbm_bytes_per_s"):
        bound = peaks["hbm_bytes_per_s"] / (2 * params)
        figures["decode_batch1_hbm_bound_tokens_per_s"] = bound
        figures["decode_batch1_of_hbm_bound"] = gen[1].get("decode_tokens_per_second", 0) / bound
    else:
        figures["decode_batch1_of_hbm_bound"] = "absent: no HBM bandwidth for this device (see peaks)"
    return figures


print(json.dumps({"train": train, "compare": compare, "profile": profile, "profiled": profiled,
                  "generate": generate}[kind]()))
PY
}
stage_model() {
  local model="$out/model" failures=()
  record model "{\"preset\": \"$preset\", \"batch\": $batch, \"seq\": $seq, \"steps\": $steps, \"fp16_steps\": $fp16_steps}"
  mt init-model --preset "$preset" --set vocab_size=151936 --torch_dtype bfloat16 --seed 1 --out "$model" > /dev/null
  cp "$tokenizer"/tokenizer*.json "$model/"
  python3 "$root/tools/make_bench_text.py" "$out/train.jsonl" 64 0 "$seq"  # seq - 11 to seq - 2 tokens each
  # attempt PART LOG COMMAND...: memtune COMMAND within what is left of the stage, its output in
  # LOG; a failure is recorded as model.PART_status and the stage goes on to its other parts.
  attempt() {
    local part="$1" log="$2" rc=0
    shift 2
    with_driver timeout "$(stage_left)" "$memtune_bin" "$@" > "$log" 2>&1 || rc=$?
    ((rc == 0)) && return 0
    failures+=("$part")
    local why="failed (exit $rc)"
    ((rc == 124)) && why="failed (exit 124: out of budget)"
    echo "model: $part $why:" >&2
    { grep -i -m 1 error "$log" || true; tail -n 5 "$log"; } >&2
    # (memtune's error goes to stderr, ahead of what stdout buffered: the first line naming an
    # error, then the log's end)
    record "model.${part}_status" "$(python3 -c 'import json, sys; lines = open(sys.argv[2], errors="replace").read().splitlines()
print(json.dumps({"status": sys.argv[1], "error": next((l for l in lines if "error" in l.lower()), None),
                  "log_tail": lines[-5:]}))' "$why" "$log")"
    return 1
  }
  # The timed steps run as a user's do (the host records step N+1 while the device runs step N);
  # the per-shader profile runs every dispatch alone, so it comes from a step of its own, after
  # every training figure is written. --bf16 first: float32 arithmetic, what the stage measured
  # before the float16 variant existed. --fp16 takes more steps: its loss scale starts at 65536
  # and halves after each step whose gradients overflow, a step that updates nothing and whose
  # time no log line reports (3 such steps on the tiny model, 64 tokens, reference backend).
  local train=(train --backend vulkan --model_name_or_path "$model" --train_file "$out/train.jsonl" --tuner_type full
               --per_device_train_batch_size "$batch" --max_length "$seq" --logging_steps 1 --save_strategy no
               --learning_rate 1e-5 --lr_scheduler_type constant --overwrite_output_dir)
  local variant n
  for variant in bf16 fp16; do
    n=$steps
    [[ $variant == fp16 ]] && n=$fp16_steps
    if attempt "train_$variant" "$out/train-$variant.log" "${train[@]}" "--$variant" --max_steps "$n" \
      --output_dir "$out/train-$variant"; then
      grep -m 1 '^arithmetic: ' "$out/train-$variant.log" || true
      tail -n 2 "$out/train-$variant.log"
      record "model.train_full_$variant" "$(model_figures train "$variant")"
    fi
  done
  record model.fp16_against_bf16 "$(model_figures compare)"
  python3 -c 'import json, sys; c = json.load(open(sys.argv[1]))["model"]["fp16_against_bf16"]
print("fp16 against bf16:", "%.2fx tokens/s" % c["tokens_per_s_ratio"] if isinstance(c, dict) else c)' "$json"
  for variant in bf16 fp16; do
    MEMTUNE_VULKAN_PROFILE=1 attempt "profile_$variant" "$out/profile-$variant.log" "${train[@]}" "--$variant" \
      --max_steps 1 --output_dir "$out/profile-$variant" || true
  done
  record model.profile_by_shader "$(model_figures profile)"
  record model.fp16_against_bf16_profiled "$(model_figures profiled)"
  python3 -c 'import json, sys; c = json.load(open(sys.argv[1]))["model"]["fp16_against_bf16_profiled"]
print("fp16 against bf16, profiled step:", "%.2fx device seconds, %.2fx in the products" %
      (c["step_speedup"], c["product_speedup"]) if isinstance(c, dict) else c)' "$json"
  python3 - "$out/prompts.jsonl" <<'PY'
import json, random, sys
random.seed(1)
with open(sys.argv[1], "w") as f:
    for _ in range(8):
        f.write(json.dumps({"prompt_ids": [random.randrange(151643) for _ in range(512)]}) + "\n")
PY
  head -n 1 "$out/prompts.jsonl" > "$out/prompt1.jsonl"
  local b input generated=1
  for b in 1 8; do
    input="$out/prompts.jsonl"
    [[ $b == 1 ]] && input="$out/prompt1.jsonl"
    attempt "generate_batch$b" "$out/generate$b.log" generate --backend vulkan --model "$model" --input "$input" \
      --max_new_tokens "$new_tokens" --temperature 0 --ignore_eos --max_num_seqs "$b" --max_num_batched_tokens 4096 \
      --json --output "$out/gen$b.jsonl" || { generated=0; continue; }
    # --json's statistics: one line (the generated tokens are in --output).
    grep '"prefill_tokens_per_second"' "$out/generate$b.log" | tail -n 1 > "$out/generate$b.json"
  done
  ((generated)) && record model.generate "$(model_figures generate)"
  ((${#failures[@]} == 0)) || { echo "model: failed: ${failures[*]}" >&2; return 1; }
}

# --- trainer: Hugging Face Trainer on the GPU, where it imports --------------------------------
stage_trainer() {
  local has
  has="$(python3 - <<'PY'
import importlib, json
found = {}
for name in ("torch", "transformers", "peft"):
    try:
        found[name] = importlib.import_module(name).__version__
    except Exception:  # absent, or present and broken: either way no Trainer rows
        found[name] = None
found["cuda"] = bool(found["torch"]) and importlib.import_module("torch").cuda.is_available()
print(json.dumps(found))
PY
)"
  record python3 "$has"
  if ! python3 -c 'import json, sys; d = json.loads(sys.argv[1]); sys.exit(0 if all(d.values()) else 1)' "$has"; then
    echo "(python3 here: $has; Trainer needs torch with CUDA, transformers and PEFT: no Trainer rows)"
    record trainer '"not run: python3 lacks torch with CUDA, transformers or PEFT (see python3)"'
    return 0
  fi
  # hf_trainer_bench.py checks its tokenization against memtune's, run with the bundle.
  printf '#!/bin/sh\nexec env LD_LIBRARY_PATH=%q %q "$@"\n' "$library_path" "$memtune_bin" > "$out/memtune-wrapper"
  chmod +x "$out/memtune-wrapper"
  local rows="{}" tuner line
  for tuner in full lora; do
    line="$(timeout "$(stage_left)" python3 "$root/bench/hf_trainer_bench.py" train --device cuda --model "$out/model" \
      --tokenizer "$tokenizer" --data "$out/train.jsonl" --memtune "$out/memtune-wrapper" --steps "$steps" \
      --batch "$batch" --max_length "$seq" --tuner "$tuner" --precision bf16 | tail -n 1)"
    rows="$(python3 -c 'import json,sys; d=json.loads(sys.argv[1]); d[sys.argv[2]]=json.loads(sys.argv[3]); print(json.dumps(d))' \
      "$rows" "$tuner" "$line")"
    record trainer "$rows"
  done
}

run_stage devices stage_devices
driver_files="$(cat "$out/driver_files" 2> /dev/null || true)"
if [[ " ${failed[*]} " == *" devices "* ]]; then
  echo "device-check: no device, so no further stage (out/device-check/device-check.json)" >&2
  exit 1
fi
run_stage ops stage_ops
run_stage e2e stage_e2e
run_stage model stage_model
run_stage trainer stage_trainer
record bundle_commit "\"$(cat "${bundle:-/nonexistent}/COMMIT" 2> /dev/null || git -C "$root" rev-parse --short=10 HEAD)\""
cat "$json"
echo
if ((${#failed[@]})); then
  echo "device-check: failed stages: ${failed[*]} (logs in out/device-check/)" >&2
  exit 1
fi
echo "device-check: every stage passed in $((SECONDS - started)) s"
