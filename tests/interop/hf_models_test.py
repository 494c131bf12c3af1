"""memtune's models and adapters opened by transformers and PEFT, and theirs opened by memtune.

    PY tests/interop/hf_models_test.py --memtune BIN --workdir DIR [--families qwen2,qwen3,llama]

PY is the pinned Hugging Face environment (scripts/prepare-hf-env.sh). For Qwen2.5, Qwen3 and
Llama 3 (memtune's tiny presets; a byte-level tokenizer, tests/support/byte_tokenizer.py):

1. memtune -> transformers. Models written by `memtune init-model` (float32 with tied
   embeddings; bfloat16 with an untied head, sharded with an index), `memtune train` (full
   fine-tuning, sharded: float32 tied, --bf16 tied, bfloat16 untied) and `memtune merge` load with
   AutoModelForCausalLM.from_pretrained with no missing, unexpected or mismatched tensor and no
   warning from transformers (config.json and generation_config.json included); their logits
   equal `memtune dump`'s (transformers in float32 over the stored weights: within 1e-4 of the
   largest logit) and greedy decoding gives memtune's tokens.
2. memtune LoRA -> PEFT. PeftModel.from_pretrained on memtune's adapter gives `memtune dump
   --adapter`'s logits; PEFT's merge_and_unload equals `memtune merge`, tensor by tensor.
3. transformers -> memtune. save_pretrained of models transformers built from a config (float32
   sharded by max_shard_size, and bfloat16) load in memtune with transformers' logits. A LoRA
   adapter PEFT trained one step gives PEFT's logits in `memtune dump --adapter`, PEFT's greedy
   tokens in `memtune generate --adapter` and in `memtune serve` (an OpenAI completion), PEFT's
   mean loss in `memtune eval --adapter`, and `memtune merge` of the two opens in transformers
   (generation_config.json included) with PEFT's logits; `memtune train --adapter` goes on
   training it: a step
   at learning rate 0 logs PEFT's loss and writes the adapter back unchanged, and a step at a
   positive rate changes it.

Each comparison fails on a NaN or an infinity (tests/support/numeric.py). Exit status 0 only if
every check passes.
"""

import contextlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import urllib.request
import warnings

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "support"))
import memtune_cli  # noqa: E402
from byte_tokenizer import EOS_ID, write_tokenizer  # noqa: E402
from hf_checks import dtype_argument, run_families, saved_dtype  # noqa: E402
from numeric import assert_close, check  # noqa: E402

import transformers  # noqa: E402
import peft  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

LOGIT_RTOL = 1e-4   # of the largest |logit|: float32 on both sides, different summation orders
MERGE_RTOL = 1e-6   # merged weights: W + s * B A in float32 on both sides
LOSS_RTOL = 1e-5
PRESETS = {"qwen2": "tiny", "qwen3": "tiny-qwen3", "llama": "tiny-llama"}
VOCAB = EOS_ID + 3  # the byte tokenizer's 259 ids; the presets' vocabularies hold them
TEXTS = ["the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs!",
         "sphinx of black quartz, judge my vow", "how vexingly quick daft zebras jump; 0123",
         "waltz, bad nymph, for quick jigs vex", "glib jocks quiz nymph to vex dwarf"]
PROMPTS = [[116, 104, 101, 32, 113], [112, 97, 99, 107, 32, 109, 121, 32, 98]]
NEW_TOKENS = 8
# Weights of N(0, 0.1) (init-model's --set initializer_range, transformers' initializer_range):
# logits of order 1 with attention far from uniform, so a wrong rotary frequency or a misread
# tensor moves them well past the tolerance (0.02 would hide a 1% rope_theta error).
INIT_STD = 0.1


def run(args):
    return memtune_cli.run(args).stdout


@contextlib.contextmanager
def no_transformers_warnings(what):
    """Fails when transformers (or PEFT) logs a warning or raises a Python warning inside."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.WARNING)
    loggers = [logging.getLogger("transformers"), logging.getLogger("peft")]
    for lg in loggers:
        lg.addHandler(handler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for lg in loggers:
        lg.removeHandler(handler)
    said = stream.getvalue().strip()
    caught = [str(w.message) for w in caught if "TypedStorage" not in str(w.message)]
    check(not said and not caught, lambda: f"{what}: transformers warned: {said} {caught}")


def hf_load(model_dir):
    """The checkpoint in transformers, computing in float32 over the stored values."""
    with no_transformers_warnings(f"from_pretrained({model_dir})"):
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir, **dtype_argument(torch.float32), output_loading_info=True)
        if os.path.exists(os.path.join(model_dir, "generation_config.json")):
            transformers.GenerationConfig.from_pretrained(model_dir)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        check(not info[key], lambda: f"{model_dir}: transformers reports {key} {info[key]}")
    return model.eval()


def batch():
    rows = [list(t.encode())[:24] for t in TEXTS[:3]]
    n = min(len(r) for r in rows)
    return [r[:n] for r in rows]


def memtune_logits(memtune, workdir, model_dir, adapter=None):
    ids = batch()
    inp = os.path.join(workdir, "dump_in.json")
    out = os.path.join(workdir, "dump_out.safetensors")
    with open(inp, "w") as f:
        json.dump({"input_ids": ids}, f)
    run([memtune, "dump", "--model", model_dir, "--input", inp, "--out", out] +
        (["--adapter", adapter] if adapter else []))
    return load_file(out)["logits"]


def hf_logits(model):
    with torch.no_grad():
        return model(torch.tensor(batch())).logits.float().numpy()


def hf_greedy(model):
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False, pad_token_id=EOS_ID)
            out.append(ids[0, len(p):].tolist())
    return out


def memtune_greedy(memtune, workdir, model_dir, adapter=None):
    inp = os.path.join(workdir, "prompts.jsonl")
    with open(inp, "w") as f:
        for p in PROMPTS:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    out = os.path.join(workdir, "generated.jsonl")
    run([memtune, "generate", "--model", model_dir, "--input", inp, "--output", out, "--temperature", "0",
         "--max_new_tokens", NEW_TOKENS, "--ignore_eos", "--skip_tokenizer_init", "--json"] +
        (["--adapter", adapter] if adapter else []))
    return [json.loads(line)["token_ids"] for line in open(out)]


def same_greedy(got, model, what):
    """Greedy tokens equal for every prompt, NEW_TOKENS each (both sides ignore EOS); where they
    part, transformers' own logits must show a tie (the two best within LOGIT_RTOL of the largest
    logit), which float32 rounding may break either way. A missing prompt's result, or a sequence
    that stops early, is a difference."""
    want = hf_greedy(model)
    check(len(got) == len(PROMPTS) and len(want) == len(PROMPTS),
          lambda: f"{what}: {len(got)} results from memtune and {len(want)} from transformers for {len(PROMPTS)} prompts")
    for p, g, w in zip(PROMPTS, got, want):
        check(len(g) == NEW_TOKENS and len(w) == NEW_TOKENS,
              lambda: f"{what}: prompt {p}: memtune gave {len(g)} tokens, transformers {len(w)}, both should give "
                      f"{NEW_TOKENS}: memtune {g}, transformers {w}")
        if len(g) != len(w) or g == w:
            continue
        k = next(i for i in range(len(g)) if g[i] != w[i])
        with torch.no_grad():
            logits = model(torch.tensor([p + w[:k]])).logits[0, -1].float()
        gap = float(logits[w[k]] - logits[g[k]])
        check(gap <= LOGIT_RTOL * float(logits.abs().max()),
              lambda: f"{what}: prompt {p}: memtune {g}, transformers {w}; they part at {k} where transformers' "
                      f"logit of its token is {gap:.3g} above memtune's: not a tie")


def check_model_dir(memtune, workdir, model_dir, what, greedy=True):
    model = hf_load(model_dir)
    assert_close(memtune_logits(memtune, workdir, model_dir), hf_logits(model), rtol=LOGIT_RTOL,
                 what=f"{what}: logits, memtune against transformers")
    if greedy:
        same_greedy(memtune_greedy(memtune, workdir, model_dir), model, what)
    return model


def sharded(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if not os.path.exists(index):
        return 0
    return len(set(json.load(open(index))["weight_map"].values()))


def write_texts(path, texts):
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t}) + "\n")


def train(memtune, model_dir, train_file, out_dir, *extra):
    shutil.rmtree(out_dir, ignore_errors=True)
    run([memtune, "train", "--model", model_dir, "--train_file", train_file, "--output_dir", out_dir,
         "--per_device_train_batch_size", 2, "--max_steps", 2, "--learning_rate", 5e-3, "--logging_steps", 1,
         "--save_strategy", "no", "--lr_scheduler_type", "constant", "--max_length", 64, *extra])
    return out_dir


# --- 1 and 2: memtune's files in transformers and PEFT ----------------------------------------

def memtune_to_hf(memtune, workdir, family, checks):
    preset = PRESETS[family]
    base = os.path.join(workdir, family, "init_f32")
    train_file = os.path.join(workdir, "train.jsonl")
    write_texts(train_file, TEXTS)

    with checks.case(f"{family}: init-model float32, tied embeddings"):
        run([memtune, "init-model", "--preset", preset, "--out", base, "--set", "tie_word_embeddings=true",
             "--set", f"initializer_range={INIT_STD}"])
        write_tokenizer(base)
        check_model_dir(memtune, workdir, base, "init float32")

    with checks.case(f"{family}: init-model bfloat16, untied head, sharded"):
        d = os.path.join(workdir, family, "init_bf16")
        run([memtune, "init-model", "--preset", preset, "--out", d, "--torch_dtype", "bfloat16",
             "--set", "tie_word_embeddings=false", "--set", f"initializer_range={INIT_STD}", "--max_shard_size", "60KB"])
        check(sharded(d) > 1, f"{d}: expected several shards with an index")
        write_tokenizer(d)
        model = check_model_dir(memtune, workdir, d, "init bfloat16")
        check(not model.config.tie_word_embeddings, "the untied head reads as tied")

    untied_bf16 = os.path.join(workdir, family, "init_bf16")
    for k, (start, dtype_flags, name) in enumerate(((base, [], "float32, tied"),
                                                    (base, ["--bf16"], "bfloat16 (--bf16), tied"),
                                                    (untied_bf16, [], "bfloat16, untied"))):
        with checks.case(f"{family}: train full fine-tuning {name}, sharded"):
            out = train(memtune, start, train_file, os.path.join(workdir, family, f"full_{k}"),
                        "--tuner_type", "full", "--max_shard_size", "60KB", *dtype_flags)
            check(sharded(out) > 1, f"{out}: expected several shards with an index")
            written = json.load(open(os.path.join(out, "config.json")))
            want_dtype = "float32" if name.startswith("float32") else "bfloat16"
            check(written["torch_dtype"] == want_dtype and written["tie_word_embeddings"] != name.endswith("untied"),
                  lambda: f"{out}/config.json: torch_dtype {written['torch_dtype']}, tied {written['tie_word_embeddings']}")
            check_model_dir(memtune, workdir, out, f"train full {name}")

    with checks.case(f"{family}: LoRA adapter in PEFT, merge against merge_and_unload"):
        adapter = train(memtune, base, train_file, os.path.join(workdir, family, "lora"),
                        "--tuner_type", "lora", "--lora_rank", 4, "--lora_alpha", 8, "--lora_dropout", 0,
                        "--target_modules", "all-linear")
        with no_transformers_warnings("PeftModel.from_pretrained"):
            model = peft.PeftModel.from_pretrained(hf_load(base), adapter).eval()
        assert_close(memtune_logits(memtune, workdir, base, adapter), hf_logits(model), rtol=LOGIT_RTOL,
                     what="logits with the adapter, memtune against PEFT")
        merged = os.path.join(workdir, family, "merged")
        run([memtune, "merge", "--model", base, "--adapter", adapter, "--out", merged])
        theirs = {k: v.detach().float().numpy() for k, v in model.merge_and_unload().state_dict().items()}
        ours = load_file(os.path.join(merged, "model.safetensors"))
        tied = hf_load(merged).config.tie_word_embeddings
        check(set(ours) == set(theirs) - ({"lm_head.weight"} if tied else set()),
              lambda: f"merged tensors differ: memtune only {sorted(set(ours) - set(theirs))}, "
                      f"PEFT only {sorted(set(theirs) - set(ours))}")
        changed = 0
        for k, v in ours.items():
            assert_close(v, theirs[k], rtol=MERGE_RTOL, what=f"merged {k}, memtune against PEFT")
            changed += int(not np.array_equal(v, load_file(os.path.join(base, "model.safetensors"))[k]))
        check(changed >= 7, f"the adapter changed only {changed} merged tensors")
        check_model_dir(memtune, workdir, merged, "merged")


# --- 3: transformers' files in memtune ---------------------------------------------------------

def hf_config(family):
    common = dict(vocab_size=VOCAB + 61, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=INIT_STD, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(tie_word_embeddings=True, **common)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=16, tie_word_embeddings=True, **common)
    common = {k: v for k, v in common.items() if "sliding" not in k}
    return transformers.LlamaConfig(tie_word_embeddings=False, rope_theta=500000.0,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 64}, **common)


def lm_batch(texts):
    """Byte ids + eos per text, right-padded; labels -100 on padding (memtune's text format)."""
    seqs = [list(t.encode()) + [EOS_ID] for t in texts]
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), EOS_ID)
    labels = torch.full((len(seqs), n), -100)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, labels, mask


def token_mean_loss(model, texts):
    """The mean cross-entropy over every target token of every text (one global mean)."""
    ids, labels, mask = lm_batch(texts)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    targets = labels[:, 1:]
    return float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                   targets.reshape(-1), ignore_index=-100, reduction="sum")
                 / (targets != -100).sum())


def served_greedy(memtune, model_dir, adapter):
    """PROMPTS through `memtune serve` (OpenAI completions with token-id prompts), greedy."""
    server = subprocess.Popen([memtune, "serve", model_dir, "--port", "0", "--skip_tokenizer_init",
                               "--lora_modules", f"a={adapter}", "--max_model_len", "64"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said = ""
        while True:
            line = server.stdout.readline()
            check(line, lambda: f"memtune serve exited before listening:\n{said}")
            said += line
            m = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
            if m:
                break
        out = []
        for p in PROMPTS:
            body = json.dumps({"model": "a", "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,
                               "ignore_eos": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{m.group(1)}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as r:
                out.append(json.load(r)["choices"][0]["token_ids"])
        return out
    finally:
        server.kill()
        server.wait()


def hf_to_memtune(memtune, workdir, family, checks):
    torch.manual_seed({"qwen2": 1, "qwen3": 2, "llama": 3}[family])
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family)).eval()
    f32 = os.path.join(workdir, family, "hf_f32")
    with checks.case(f"{family}: transformers' float32 save_pretrained, sharded"):
        shutil.rmtree(f32, ignore_errors=True)
        model.save_pretrained(f32, max_shard_size="60KB")
        write_tokenizer(f32)
        check(sharded(f32) > 1, f"{f32}: transformers wrote no shards")
        assert_close(memtune_logits(memtune, workdir, f32), hf_logits(model), rtol=LOGIT_RTOL,
                     what="logits of transformers' float32 checkpoint, memtune against transformers")
    with checks.case(f"{family}: transformers' bfloat16 save_pretrained"):
        d = os.path.join(workdir, family, "hf_bf16")
        shutil.rmtree(d, ignore_errors=True)
        transformers.AutoModelForCausalLM.from_pretrained(f32, **dtype_argument(torch.bfloat16)).save_pretrained(d)
        check(saved_dtype(json.load(open(os.path.join(d, "config.json")))) == "bfloat16", "not saved as bfloat16")
        assert_close(memtune_logits(memtune, workdir, d), hf_logits(hf_load(d)), rtol=LOGIT_RTOL,
                     what="logits of transformers' bfloat16 checkpoint, memtune against transformers")

    adapter = os.path.join(workdir, family, "peft_adapter")
    with checks.case(f"{family}: a LoRA adapter PEFT trained one step, in dump, generate, serve and eval"):
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        lora = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(f32),
                                   peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
        ids, labels, mask = lm_batch(TEXTS[:2])
        opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
        lora.train()
        lora(input_ids=ids, labels=labels, attention_mask=mask).loss.backward()
        opt.step()
        lora.eval()
        shutil.rmtree(adapter, ignore_errors=True)
        lora.save_pretrained(adapter)
        check(any(float(p.abs().max()) > 0 for n, p in lora.named_parameters() if "lora_B" in n),
              "PEFT's step left every lora_B zero")
        assert_close(memtune_logits(memtune, workdir, f32, adapter), hf_logits(lora), rtol=LOGIT_RTOL,
                     what="logits with PEFT's adapter, memtune against PEFT")
        want = hf_greedy(lora)
        same_greedy(memtune_greedy(memtune, workdir, f32, adapter), lora, "generate --adapter")
        same_greedy(served_greedy(memtune, f32, adapter), lora, "serve --lora_modules")
        check(want != hf_greedy(model), "the adapter changes no greedy token: the comparison shows nothing")
        eval_file = os.path.join(workdir, "eval.jsonl")
        write_texts(eval_file, TEXTS)
        out = run([memtune, "eval", "--model", f32, "--adapter", adapter, "--eval_file", eval_file, "--json",
                   "--per_device_eval_batch_size", 4, "--max_length", 64])
        got = json.loads(out.strip().splitlines()[-1])["eval_loss"]
        assert_close(got, token_mean_loss(lora, TEXTS), rtol=LOSS_RTOL, what="eval_loss with PEFT's adapter")
        # memtune merge of transformers' model (its generation_config.json goes along) and PEFT's
        # adapter, opened by transformers again.
        merged = os.path.join(workdir, family, "hf_merged")
        run([memtune, "merge", "--model", f32, "--adapter", adapter, "--out", merged])
        check(os.path.exists(os.path.join(merged, "generation_config.json")), "merge left generation_config.json out")
        assert_close(hf_logits(hf_load(merged)), hf_logits(lora), rtol=LOGIT_RTOL,
                     what="memtune merge of transformers' model and PEFT's adapter, against PEFT")

    with checks.case(f"{family}: memtune train --adapter goes on training PEFT's adapter"):
        train_file = os.path.join(workdir, "train_two.jsonl")
        write_texts(train_file, TEXTS[:2])
        common = ["--adapter", adapter, "--tuner_type", "lora", "--per_device_train_batch_size", 2,
                  "--max_steps", 1, "--logging_steps", 1, "--save_strategy", "no", "--lr_scheduler_type", "constant",
                  "--max_length", 64, "--max_grad_norm", 0]
        still = os.path.join(workdir, family, "resumed_lr0")
        shutil.rmtree(still, ignore_errors=True)
        run([memtune, "train", "--model", f32, "--train_file", train_file, "--output_dir", still,
             "--learning_rate", 0, *common])
        logged = json.load(open(os.path.join(still, "trainer_state.json")))["log_history"][0]["loss"]
        assert_close(logged, token_mean_loss(lora, TEXTS[:2]), rtol=LOSS_RTOL,
                     what="the first step's loss with PEFT's adapter, memtune against PEFT")
        before = load_file(os.path.join(adapter, "adapter_model.safetensors"))
        after = load_file(os.path.join(still, "adapter_model.safetensors"))
        check(set(before) == set(after), lambda: f"tensor names changed: {sorted(set(before) ^ set(after))}")
        for k in before:
            check(np.array_equal(before[k], after[k]), f"{k} changed at learning rate 0")
        moved = os.path.join(workdir, family, "resumed")
        shutil.rmtree(moved, ignore_errors=True)
        run([memtune, "train", "--model", f32, "--train_file", train_file, "--output_dir", moved,
             "--learning_rate", 1e-2, *common])
        after = load_file(os.path.join(moved, "adapter_model.safetensors"))
        check(all(not np.array_equal(before[k], after[k]) for k in before if "lora_A" in k),
              "a step at learning rate 1e-2 left a lora_A unchanged")


if __name__ == "__main__":
    run_families(memtune_to_hf, hf_to_memtune)
