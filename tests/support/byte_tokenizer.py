"""A byte-level tokenizer for tiny test models: token id b is byte b (0..255), then
<|endoftext|> (EOS_ID), <|im_start|> and <|im_end|>; no merges. Written as Hugging Face's
tokenizer.json, so memtune, `tokenizers` and transformers all read the same file."""

import json
import os

EOS_ID = 256


def gpt2_byte_stand_ins():
    """GPT-2's printable stand-in character for each byte (the ByteLevel pre-tokenizer's alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    codepoints = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in codepoints:
            codepoints[b] = 256 + extra
            extra += 1
    return {b: chr(c) for b, c in codepoints.items()}


def write_tokenizer(model_dir):
    """Writes tokenizer.json and tokenizer_config.json (eos and pad <|endoftext|>) into model_dir."""
    stand_ins = gpt2_byte_stand_ins()
    added = [{"id": EOS_ID + i, "content": token, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True}
             for i, token in enumerate(("<|endoftext|>", "<|im_start|>", "<|im_end|>"))]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": True}
    doc = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
           "pre_tokenizer": byte_level, "post_processor": byte_level, "decoder": byte_level,
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                     "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                     "vocab": {stand_ins[b]: b for b in range(256)}, "merges": []}}
    with open(os.path.join(model_dir, "tokenizer.json"), "w") as f:
        json.dump(doc, f)
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "model_max_length": 32768}, f)
