#!/usr/bin/env bash
# The vulkan backend on a GPU, in one run, in stages under a total budget (8 minutes by default,
# MEMTUNE_CHECK_BUDGET_S). Each stage writes its part of out/device-check/device-check.json before
# the next starts, so a late failure or the budget running out keeps the earlier figures:
#   devices   `memtune devices`: the device --backend vulkan takes, and which driver manifest the
#             Vulkan loader was given (below);
#   ops       the vulkan op table (VulkanOps.*, BackendOps.*) on that device;
#   e2e       the end-to-end test on it (every command on vulkan against cpu, resume bit-identical);
#   model     a Qwen2.5-0.5B-shaped bfloat16 model (random weights): full fine-tuning steps
#             (tokens/s, MFU against MEMTUNE_PEAK_FLOPS, the waits per step), the per-shader
#             profile of two more steps (MEMTUNE_VULKAN_PROFILE), prefill and batch-1 / batch-8 decode (tokens/s against the
#             bound MEMTUNE_HBM_BYTES_PER_S sets), the device's own memory use against the plan;
#   trainer   where python3 imports transformers and torch sees CUDA: Hugging Face Trainer on the
#             same model, batch and steps (bf16 autocast, SDPA attention, fused AdamW; full and
#             PEFT LoRA; bench/hf_trainer_bench.py): tokens/s and torch.cuda.max_memory_allocated.
# The exit status is 0 only if every stage that ran passed.
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
#       out/device-check/bundle and runs the stages with it.
# Without --from, build/ is built and used. Library paths and the driver manifest are set for
# memtune's processes only, never for python3 (whose PyTorch brings its own libraries). When the
# loader finds no device by itself, the first manifest that gives one is taken from
# $MEMTUNE_VULKAN_DRIVER_DIRS (default: /usr/local/nvidia/share/vulkan/icd.d, then
# /usr/local/share/vulkan/icd.d, /usr/share/vulkan/icd.d, /etc/vulkan/icd.d), a GPU before a CPU.
# MEMTUNE_VULKAN_DEVICE picks another device. Small settings for a smoke run on lavapipe:
#   MEMTUNE_CHECK_PRESET=tiny MEMTUNE_CHECK_BATCH=1 MEMTUNE_CHECK_STEPS=2 MEMTUNE_CHECK_NEW_TOKENS=4
#   MEMTUNE_CHECK_ALLOW_CPU=1 (scripts/device-check-bare-root.sh runs exactly that in a bare root).
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
preset="${MEMTUNE_CHECK_PRESET:-qwen2.5-0.5b}" batch="${MEMTUNE_CHECK_BATCH:-8}"
steps="${MEMTUNE_CHECK_STEPS:-6}" new_tokens="${MEMTUNE_CHECK_NEW_TOKENS:-128}"
budget="${MEMTUNE_CHECK_BUDGET_S:-480}"
started=$SECONDS
driver_files="${VK_DRIVER_FILES:-${VK_ICD_FILENAMES:-}}"

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

# The JSON so far: `record KEY JSON` sets one key and rewrites the file.
json="$out/device-check.json"
echo '{}' > "$json"
record() {
  python3 - "$json" "$1" "$2" <<'EOF'
import json, sys
path, key, value = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
doc = json.load(open(path))
doc[key] = value
json.dump(doc, open(path + ".tmp", "w"), indent=2)
EOF
  mv "$json.tmp" "$json"
}
failed=()
# run_stage NAME FUNCTION: the stage under what is left of the budget; its failure is recorded and
# the next stage still runs.
run_stage() {
  local name="$1" rc=0 limit
  limit=$(left)
  echo "== $name ($limit s of the budget left)"
  if ((limit < 10)); then
    record "$name" '{"status": "skipped: the budget ran out"}'
    failed+=("$name")
    return
  fi
  # A subshell with -e of its own (a function called from `||` would run with -e ignored).
  set +e
  (set -e; STAGE_LIMIT=$limit "$2")
  rc=$?
  set -e
  if ((rc != 0)); then
    failed+=("$name")
    local why="failed (exit $rc)"
    ((rc == 124)) && why="failed (exit 124: out of budget)"
    record "${name}_status" "\"$why\""
  fi
  record seconds "$((SECONDS - started))"
}

# --- devices: which device, which driver -------------------------------------------------------
devices_json() { with_driver timeout 60 "$memtune_bin" devices --json 2> /dev/null; }
# 0 when the current driver setting lists a device (a GPU unless MEMTUNE_CHECK_ALLOW_CPU=1).
usable_device() {
  local d
  d="$(devices_json)" || return 1
  python3 - "$d" <<'EOF'
import json, os, sys
d = json.loads(sys.argv[1])
chosen = d.get("backend_vulkan_device")
if chosen is None:
    sys.exit(1)
device = next(x for x in d["devices"] if x["index"] == chosen)
sys.exit(0 if "CPU" not in device["type"] or os.environ.get("MEMTUNE_CHECK_ALLOW_CPU") == "1" else 1)
EOF
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
}

# --- ops and e2e: the test binary on the device ------------------------------------------------
gtest_stage() {
  local name="$1" filter="$2"
  local rc=0
  MEMTUNE_REQUIRE_ALL_TESTS=1 with_driver timeout "$STAGE_LIMIT" "$tests_bin" --gtest_filter="$filter" \
    > "$out/$name.log" 2>&1 || rc=$?
  grep -E '^\[  (PASSED|FAILED) ' "$out/$name.log" || true
  record "$name" "$(python3 - "$out/$name.log" "$rc" <<'EOF'
import json, re, sys
text = open(sys.argv[1], errors="replace").read()
print(json.dumps({"exit": int(sys.argv[2]),
                  "passed": len(re.findall(r"^\[       OK \]", text, re.M)),
                  "failed": sorted(set(re.findall(r"^\[  FAILED  \] (\S+)", text, re.M)))}))
EOF
)"
  return "$rc"
}
stage_ops() { gtest_stage ops 'VulkanOps.*:BackendOps.*'; }
stage_e2e() { gtest_stage e2e 'TrainCliTest.EveryCommandRunsOnVulkanAndAgreesWithCpu'; }

# --- model: a real shape, bfloat16 ------------------------------------------------------------
stage_model() {
  local model="$out/model"
  mt init-model --preset "$preset" --set vocab_size=151936 --torch_dtype bfloat16 --seed 1 --out "$model" > /dev/null
  cp "$tokenizer"/tokenizer*.json "$model/"
  python3 "$root/tools/make_bench_text.py" "$out/train.jsonl" 64 0  # 501-510 tokens each
  # The timed steps run as a user's do (the host records step N+1 while the device runs step N);
  # the per-shader profile runs every dispatch alone, so it comes from two more steps of its own.
  local train=(train --backend vulkan --model_name_or_path "$model" --train_file "$out/train.jsonl" --tuner_type full
               --bf16 --per_device_train_batch_size "$batch" --max_length 512 --logging_steps 1 --save_strategy no
               --learning_rate 1e-5 --lr_scheduler_type constant --overwrite_output_dir)
  with_driver timeout "$STAGE_LIMIT" "$memtune_bin" "${train[@]}" --max_steps "$steps" --output_dir "$out/train" \
    > "$out/train.log" 2>&1
  tail -n 3 "$out/train.log"
  MEMTUNE_VULKAN_PROFILE=1 with_driver timeout "$(left)" "$memtune_bin" "${train[@]}" --max_steps 2 \
    --output_dir "$out/train-profile" > "$out/train-profile.log" 2>&1
  python3 - "$out/prompts.jsonl" <<'EOF'
import json, random, sys
random.seed(1)
with open(sys.argv[1], "w") as f:
    for _ in range(8):
        f.write(json.dumps({"prompt_ids": [random.randrange(151643) for _ in range(512)]}) + "\n")
EOF
  head -n 1 "$out/prompts.jsonl" > "$out/prompt1.jsonl"
  local b input
  for b in 1 8; do
    input="$out/prompts.jsonl"
    [[ $b == 1 ]] && input="$out/prompt1.jsonl"
    with_driver timeout "$(left)" "$memtune_bin" generate --backend vulkan --model "$model" --input "$input" \
      --max_new_tokens "$new_tokens" --temperature 0 --ignore_eos --max_num_seqs "$b" --max_num_batched_tokens 4096 \
      --json --output "$out/gen$b.jsonl" > "$out/generate$b.json"
  done
  record model "$(python3 - "$out" "$batch" <<'EOF'
import json, os, re, sys
out, batch = sys.argv[1], int(sys.argv[2])
peak_flops = float(os.environ.get("MEMTUNE_PEAK_FLOPS", 67e12))      # H200: float32 on CUDA cores
hbm = float(os.environ.get("MEMTUNE_HBM_BYTES_PER_S", 4.8e12))       # H200 HBM3e
log = [json.loads(l) for l in open(f"{out}/train/log.jsonl") if l.strip()]
steps = [r for r in log if "tokens_per_second" in r]
timed = steps[1:] or steps
tokens_per_s = sum(r["tokens_per_second"] for r in timed) / len(timed)
memory = json.load(open(f"{out}/train/memory.json"))
config = json.load(open(f"{out}/model/config.json"))
d, i, L, V = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["vocab_size"]
kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
layer = d * d * 2 + d * kv * 2 + 3 * d * i
params = L * layer + V * d * (1 if config.get("tie_word_embeddings") else 2)
flops_per_token = 6 * (L * layer + V * d)  # forward + backward of every matmul, the head included
# Per shader: device seconds (timestamps around each dispatch, run alone), workgroups, and the
# FLOPs and bytes each dispatch is designed for (src/backend/vulkan/geometry.cpp), with the rates.
profile = {m.group(1): {"seconds": float(m.group(2)), "dispatches": int(m.group(3)), "workgroups": int(m.group(4)),
                        "gflop": float(m.group(5)), "gb": float(m.group(6)), "gflop_per_s": float(m.group(7)),
                        "gb_per_s": float(m.group(8))}
           for m in re.finditer(r"vulkan profile: (\S+)\s+(\S+) s in (\d+) dispatches, (\d+) workgroups, "
                                r"(\S+) GFLOP, (\S+) GB: (\S+) GFLOP/s, (\S+) GB/s",
                                open(f"{out}/train-profile.log").read())}
gen = {b: json.load(open(f"{out}/generate{b}.json")) for b in (1, 8)}
print(json.dumps({
    "preset": os.environ.get("MEMTUNE_CHECK_PRESET", "qwen2.5-0.5b"),
    "train_full_bf16": {"batch": batch, "seq": 512, "timed_steps": len(timed), "tokens_per_s": tokens_per_s,
                        "mfu": tokens_per_s * flops_per_token / peak_flops, "peak_flops": peak_flops,
                        "plan_arena_bytes": memory["arena_bytes"], "device": memory.get("device"),
                        "device_work": memory.get("device_work"),
                        "phase_seconds": {k: timed[-1].get(f"{k}_seconds") for k in ("forward", "loss", "backward")},
                        "phase_clock": timed[-1].get("phase_clock")},
    "profile_by_shader": profile,
    "generate": {f"batch{b}": {k: s.get(k) for k in ("prefill_tokens_per_second", "decode_tokens_per_second")}
                 for b, s in gen.items()},
    "decode_batch1_hbm_bound_tokens_per_s": hbm / (2 * params)}))
EOF
)"
}

# --- trainer: Hugging Face Trainer on the GPU, where it imports --------------------------------
stage_trainer() {
  local has
  has="$(python3 - <<'EOF'
import importlib, json
found = {}
for name in ("torch", "transformers", "peft"):
    try:
        found[name] = importlib.import_module(name).__version__
    except Exception:  # absent, or present and broken: either way no Trainer rows
        found[name] = None
found["cuda"] = bool(found["torch"]) and importlib.import_module("torch").cuda.is_available()
print(json.dumps(found))
EOF
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
    line="$(timeout "$(left)" python3 "$root/bench/hf_trainer_bench.py" train --device cuda --model "$out/model" \
      --tokenizer "$tokenizer" --data "$out/train.jsonl" --memtune "$out/memtune-wrapper" --steps "$steps" \
      --batch "$batch" --max_length 512 --tuner "$tuner" --precision bf16 | tail -n 1)"
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
if ((${#failed[@]})); then
  echo "device-check: failed stages: ${failed[*]} (logs in out/device-check/)" >&2
  exit 1
fi
echo "device-check: every stage passed in $((SECONDS - started)) s"
