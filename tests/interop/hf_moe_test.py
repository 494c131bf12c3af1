"""Mixture-of-experts Qwen (Qwen3MoeForCausalLM, Qwen2MoeForCausalLM) between transformers and memtune.

    PY tests/interop/hf_moe_test.py --memtune BIN --workdir DIR [--families qwen3_moe,qwen2_moe]

PY is the pinned Hugging Face environment (scripts/prepare-hf-env.sh). For each family, a tiny
configuration with many experts (qwen3_moe: 16 experts, 4 a token, renormalized, layer 1 dense
through mlp_only_layers; qwen2_moe: 12 experts, 3 a token, not renormalized, a gated shared
expert, layer 0 dense through decoder_sparse_step 2), with one expert's router row scaled so
that it takes about half the tokens while some take one or none (uneven routing, checked):

1. transformers -> memtune. save_pretrained (float32, sharded) loads in `memtune dump` with
   transformers' logits (within 1e-4 of the largest) and mean loss, on the cpu backend and on
   vulkan (Mesa's lavapipe in CI); `memtune eval` gives the same loss; greedy decoding (`memtune
   generate`, the paged-cache path, cpu and vulkan) gives transformers' tokens.
2. memtune -> transformers. `memtune init-model --preset tiny-qwen3-moe / tiny-qwen2-moe` loads
   with AutoModelForCausalLM.from_pretrained with no missing or unexpected tensor, and its logits
   equal `memtune dump`'s.
3. Full fine-tuning's gradients: on an all-sparse configuration with the auxiliary
   load-balancing loss on (output_router_logits, router_aux_loss_coef 0.3, large enough to
   show), `memtune dump` (with and without --gradient_checkpointing) against transformers' loss
   (cross-entropy plus the auxiliary term) and loss.backward(): every gradient, the router's and
   the shared expert gate's included, within hf_gradients_test's tolerance; an expert no token
   chose has a zero gradient on both sides. Then `memtune train` on it writes a checkpoint that
   transformers opens with memtune's logits.
4. LoRA on attention and on every expert's projections (PEFT's module names: gate_proj, up_proj
   and down_proj inside mlp.experts.E and mlp.shared_expert), auxiliary loss on: an adapter
   `memtune train` wrote, opened by PEFT, gives PEFT's loss and every lora_A / lora_B gradient
   in `memtune dump --adapter` (with and without checkpointing); `memtune merge` of it gives, in
   transformers, PEFT's logits; an adapter PEFT made gives PEFT's logits in memtune.

Exit status 0 only if every check passes.
"""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "support"))
sys.path.insert(0, HERE)
import hf_gradients_test as hg  # noqa: E402
import hf_models_test as hm  # noqa: E402
from byte_tokenizer import write_tokenizer  # noqa: E402
from hf_checks import run_families  # noqa: E402
from numeric import assert_close, check  # noqa: E402

import peft  # noqa: E402
import transformers  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

PRESETS = {"qwen3_moe": "tiny-qwen3-moe", "qwen2_moe": "tiny-qwen2-moe"}


def hf_config(family, aux=False):
    """The family's tiny configuration; with aux, every layer sparse and the auxiliary loss on
    (transformers 4.51 gathers a dense layer's missing router logits into the loss and fails)."""
    common = dict(vocab_size=hm.VOCAB + 61, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=hm.INIT_STD, rms_norm_eps=1e-6, use_sliding_window=False, sliding_window=None,
                  tie_word_embeddings=False)
    if aux:
        common.update(output_router_logits=True, router_aux_loss_coef=0.3)
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(head_dim=24, num_experts=16, num_experts_per_tok=4,
                                           moe_intermediate_size=32, norm_topk_prob=True,
                                           mlp_only_layers=[] if aux else [1], **common)
    return transformers.Qwen2MoeConfig(num_experts=12, num_experts_per_tok=3, moe_intermediate_size=40,
                                       shared_expert_intermediate_size=56, norm_topk_prob=False,
                                       decoder_sparse_step=1 if aux else 2, **common)


def uneven(model):
    """Expert 0's router row scaled up: it wins wherever its score is positive (about half the
    tokens), so the experts' loads differ several-fold and some take no token or one."""
    with torch.no_grad():
        for layer in model.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if isinstance(gate, torch.nn.Linear) and gate.out_features > 1:
                gate.weight[0] *= 6


def mean_loss(model, ids):
    with torch.no_grad():
        return float(model(torch.tensor(ids), labels=torch.tensor(ids)).loss)


def memtune_dump(memtune, workdir, model_dir, ids, backend="cpu", adapter=None):
    inp = os.path.join(workdir, "moe_dump_in.json")
    out = os.path.join(workdir, "moe_dump_out.safetensors")
    with open(inp, "w") as f:
        json.dump({"input_ids": ids, "labels": ids}, f)
    hm.run([memtune, "dump", "--model", model_dir, "--input", inp, "--out", out, "--backend", backend] +
           (["--adapter", adapter] if adapter else []))
    t = load_file(out)
    return t["logits"], float(t["loss"])


def vulkan_greedy(memtune, workdir, model_dir):
    inp = os.path.join(workdir, "moe_prompts.jsonl")
    with open(inp, "w") as f:
        for p in hm.PROMPTS:
            f.write(json.dumps({"prompt_ids": p}) + "\n")
    out = os.path.join(workdir, "moe_generated.jsonl")
    hm.run([memtune, "generate", "--model", model_dir, "--input", inp, "--output", out, "--temperature", "0",
            "--max_new_tokens", hm.NEW_TOKENS, "--ignore_eos", "--skip_tokenizer_init", "--json", "--backend", "vulkan"])
    return [json.loads(line)["token_ids"] for line in open(out)]


def routing_spread(model, ids):
    """How many tokens each expert of the first sparse layer takes in transformers (uneven by
    construction: the test says so when it is not)."""
    counts = None
    hook_out = {}

    def hook(_module, _inp, out):
        hook_out["logits"] = out

    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if isinstance(gate, torch.nn.Linear) and gate.out_features > 1:
            handle = gate.register_forward_hook(hook)
            with torch.no_grad():
                model(torch.tensor(ids))
            handle.remove()
            k = model.config.num_experts_per_tok
            chosen = torch.topk(torch.softmax(hook_out["logits"].float(), -1), k, dim=-1).indices
            counts = torch.bincount(chosen.flatten(), minlength=gate.out_features).tolist()
            break
    return counts


def hf_to_memtune(memtune, workdir, family, checks):
    torch.manual_seed({"qwen3_moe": 11, "qwen2_moe": 12}[family])
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family)).eval()
    uneven(model)
    d = os.path.join(workdir, family, "hf_f32")
    ids = hm.batch()
    with checks.case(f"{family}: transformers' float32 save_pretrained (sharded) in memtune dump: logits and loss"):
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d, max_shard_size="200KB")
        write_tokenizer(d)
        check(hm.sharded(d) > 1, f"{d}: transformers wrote no shards")
        counts = routing_spread(model, ids)
        tokens = len(ids) * len(ids[0])
        mean = tokens * model.config.num_experts_per_tok / len(counts or [1])
        check(counts is not None and max(counts) >= 2 * mean and min(counts) <= 1,
              lambda: f"routing is not uneven enough for the test: tokens per expert {counts} of {tokens}")
        print(f"      tokens per expert in the first sparse layer: {counts}")
        logits, loss = memtune_dump(memtune, workdir, d, ids)
        assert_close(logits, hm.hf_logits(model), rtol=hm.LOGIT_RTOL,
                     what=f"{family}: logits, memtune against transformers")
        want = mean_loss(model, ids)
        check(abs(loss - want) <= hm.LOSS_RTOL * abs(want),
              lambda: f"{family}: dump's loss {loss} against transformers' {want}")
    with checks.case(f"{family}: the same logits on --backend vulkan"):
        logits, _ = memtune_dump(memtune, workdir, d, ids, backend="vulkan")
        assert_close(logits, hm.hf_logits(model), rtol=hm.LOGIT_RTOL,
                     what=f"{family}: logits on vulkan, memtune against transformers")
    with checks.case(f"{family}: memtune eval's loss equals transformers'"):
        data = os.path.join(workdir, family, "eval.jsonl")
        hm.write_texts(data, hm.TEXTS[:3])
        out = hm.run([memtune, "eval", "--model", d, "--eval_file", data, "--json", "--per_device_eval_batch_size", 3,
                      "--max_length", 64])
        got = json.loads(out.strip().splitlines()[-1])["eval_loss"]
        want = hm.token_mean_loss(model, hm.TEXTS[:3])
        check(abs(got - want) <= 1e-4 * abs(want), lambda: f"{family}: eval_loss {got} against transformers' {want}")
    with checks.case(f"{family}: greedy decoding through the paged cache gives transformers' tokens, cpu and vulkan"):
        hm.same_greedy(hm.memtune_greedy(memtune, workdir, d), model, f"{family}: generate")
        hm.same_greedy(vulkan_greedy(memtune, workdir, d), model, f"{family}: generate --backend vulkan")


def training(memtune, workdir, family, checks):
    torch.manual_seed({"qwen3_moe": 13, "qwen2_moe": 14}[family])
    d = os.path.join(workdir, family, "aux_f32")
    shutil.rmtree(d, ignore_errors=True)
    transformers.AutoModelForCausalLM.from_config(hf_config(family, aux=True)).save_pretrained(d)
    write_tokenizer(d)
    hg.rewrite_weights(d, seed={"qwen3_moe": 5, "qwen2_moe": 6}[family])
    model = hg.hf_base(d)
    uneven(model)
    model.save_pretrained(d)
    model = hg.hf_base(d)
    loss, grads = hg.hf_loss_and_grads(model, lambda name: name)
    with torch.no_grad():
        without_aux = float(model(input_ids=torch.tensor(hg.batch()[0]), labels=torch.tensor(hg.batch()[1]),
                                  output_router_logits=False).loss)
    check(loss - without_aux > 1e-3 * abs(loss),
          lambda: f"{family}: the auxiliary term ({loss - without_aux:.3g}) is too small for the check to see it")
    unchosen = sorted(k for k, g in grads.items() if ".experts." in k and not np.any(g))
    counts = routing_spread(model, hg.batch()[0])
    print(f"      tokens per expert in the first layer: {counts}; no token: {len(unchosen) // 3} expert(s)")
    for ckpt in (False, True):
        how = " with gradient checkpointing" if ckpt else ""
        with checks.case(f"{family}: full fine-tuning{how}: memtune dump's loss (auxiliary term included) and "
                         f"every gradient against transformers' backward"):
            ids, labels = hg.batch()
            inp = os.path.join(workdir, "moe_grad_in.json")
            out = os.path.join(workdir, "moe_grad_out.safetensors")
            with open(inp, "w") as f:
                json.dump({"input_ids": ids, "labels": labels}, f)
            hm.run([memtune, "dump", "--model", d, "--input", inp, "--out", out] +
                   (["--gradient_checkpointing"] if ckpt else []))
            ours = load_file(out)
            for name in unchosen:  # no token chose the expert: exactly zero on both sides
                check(not np.any(ours.get(name, 1)), lambda: f"{family}: memtune's {name} is not zero")
            hg.compare(f"{family} full{how}", {k: v for k, v in ours.items() if k not in unchosen}, loss,
                       {k: v for k, v in grads.items() if k not in unchosen})
    with checks.case(f"{family}: memtune train's checkpoint opens in transformers with memtune's logits"):
        data = os.path.join(workdir, family, "train.jsonl")
        hm.write_texts(data, hm.TEXTS)
        out = hm.train(memtune, d, data, os.path.join(workdir, family, "trained"), "--tuner_type", "full",
                       "--gradient_checkpointing")
        trained = hm.check_model_dir(memtune, workdir, out, f"{family}: trained", greedy=False)
        check(trained.config.output_router_logits and trained.config.router_aux_loss_coef == 0.3,
              f"{family}: the trained checkpoint lost the auxiliary loss's settings")
    with checks.case(f"{family}: LoRA on attention and every expert (all-linear, PEFT's module names): memtune "
                     f"dump --adapter against PEFT's loss and gradients, with and without checkpointing"):
        adapter = os.path.join(workdir, family, "adapter")
        shutil.rmtree(adapter, ignore_errors=True)
        hm.run([memtune, "train", "--model", d, "--train_file", data, "--output_dir", adapter, "--tuner_type", "lora",
                "--lora_dropout", 0, "--lora_rank", 4, "--lora_alpha", 8, "--target_modules", "all-linear",
                "--per_device_train_batch_size", 2, "--max_steps", 3, "--learning_rate", 5e-2,
                "--lr_scheduler_type", "constant", "--save_strategy", "no", "--logging_steps", 1, "--max_length", 64])
        peft_model = peft.PeftModel.from_pretrained(hg.hf_base(d), adapter, is_trainable=True)
        loss, grads = hg.hf_loss_and_grads(peft_model, lambda name: name.replace(".default.", "."))
        check(any(".mlp.experts." in k for k in grads) and all(".lora_" in k for k in grads),
              lambda: f"{family}: PEFT's adapter is not on the experts alone with attention: {sorted(grads)[:8]}")
        unchosen = sorted(k for k, g in grads.items() if not np.any(g))  # experts no token chose; B's of A = 0
        for ckpt in (False, True):
            ids, labels = hg.batch()
            inp = os.path.join(workdir, "moe_grad_in.json")
            out = os.path.join(workdir, "moe_lora_out.safetensors")
            with open(inp, "w") as f:
                json.dump({"input_ids": ids, "labels": labels}, f)
            hm.run([memtune, "dump", "--model", d, "--input", inp, "--out", out, "--adapter", adapter] +
                   (["--gradient_checkpointing"] if ckpt else []))
            ours = load_file(out)
            for name in unchosen:
                check(not np.any(ours.get(name, 1)), lambda: f"{family}: memtune's {name} is not zero")
            hg.compare(f"{family} LoRA{' with gradient checkpointing' if ckpt else ''}",
                       {k: v for k, v in ours.items() if k not in unchosen}, loss,
                       {k: v for k, v in grads.items() if k not in unchosen})
    with checks.case(f"{family}: memtune merge folds the adapter into every expert: transformers' logits of the "
                     f"merged checkpoint equal PEFT's of base + adapter"):
        merged = os.path.join(workdir, family, "merged")
        shutil.rmtree(merged, ignore_errors=True)
        hm.run([memtune, "merge", "--model", d, "--adapter", adapter, "--out", merged])
        assert_close(hm.hf_logits(hm.hf_load(merged)), hm.hf_logits(peft_model.eval()), rtol=hm.LOGIT_RTOL,
                     what=f"{family}: merged logits against PEFT's")
    with checks.case(f"{family}: an adapter PEFT made (random lora_B) gives PEFT's logits in memtune dump"):
        torch.manual_seed(21)
        made = peft.get_peft_model(hg.hf_base(d), peft.LoraConfig(
            r=2, lora_alpha=6, lora_dropout=0.0,
            target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"]))
        with torch.no_grad():
            for name, t in made.named_parameters():
                if "lora_B" in name:
                    t.normal_(0, 0.1)
        peft_dir = os.path.join(workdir, family, "peft_adapter")
        shutil.rmtree(peft_dir, ignore_errors=True)
        made.save_pretrained(peft_dir)
        logits, _ = memtune_dump(memtune, workdir, d, hm.batch(), adapter=peft_dir)
        assert_close(logits, hm.hf_logits(made.eval()), rtol=hm.LOGIT_RTOL,
                     what=f"{family}: logits of PEFT's adapter, memtune against PEFT")


def memtune_to_hf(memtune, workdir, family, checks):
    with checks.case(f"{family}: memtune init-model --preset {PRESETS[family]} in transformers"):
        d = os.path.join(workdir, family, "memtune_init")
        shutil.rmtree(d, ignore_errors=True)
        hm.run([memtune, "init-model", "--preset", PRESETS[family], "--seed", 5, "--out", d,
                "--set", f"initializer_range={hm.INIT_STD}", "--set", f"vocab_size={hm.VOCAB}"])
        write_tokenizer(d)
        model = hm.hf_load(d)
        logits, _ = memtune_dump(memtune, workdir, d, hm.batch())
        assert_close(logits, hm.hf_logits(model), rtol=hm.LOGIT_RTOL,
                     what=f"{family}: logits of memtune's checkpoint, memtune against transformers")


if __name__ == "__main__":
    sys.argv += [] if any(a.startswith("--families") for a in sys.argv) else ["--families", ",".join(PRESETS)]
    run_families(hf_to_memtune, training, memtune_to_hf)
