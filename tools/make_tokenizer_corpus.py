#!/usr/bin/env python3
"""Writes a deterministic corpus of strings (JSONL: one JSON string per line) for testing the
tokenizer against the JavaScript reference and for benchmarking it.

Default mode: >= 1,000 short, deliberately awkward strings covering what a byte-level BPE
tokenizer with the Qwen2 pre-tokenizer regex must get right: CJK, emoji and ZWJ sequences,
flags, code, whitespace runs, tabs, CRLF, digits, contractions in odd cases, NFD accents (to
exercise NFC), right-to-left and Indic scripts, special tokens inside text (whole and partial),
zero-width characters, control characters and very long words. Invalid UTF-8 cannot be written
as JSON from Python strings; the C++ unit tests cover it instead.

--size-mb N: a larger mixed corpus (prose, code, CJK, other scripts) of about N MB of UTF-8
text, in paragraph-sized lines, for throughput measurements.

Standard library only; the same arguments always give the same bytes.
"""
import argparse
import json
import random
import sys
import unicodedata

# Fragments by category. Each is used on its own and inside random mixtures.
ENGLISH = [
    "Hello world", " Hello world", "Hello World!", "Hello, world!", "hello", " HELLO ",
    "The quick brown fox jumps over the lazy dog.", "It's a test.", "Don't stop me now",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea?",
    "We'Ve a'lL", "THEY'LL SAY IT'S FINE", "she'S", "you'Re", "it'd", "I'm", "'s", "'S'", "''''",
    "O'Neill's cat's toy", "rock 'n' roll", "'tis the season", "y'all'd've",
    "Mr. Smith went to Washington.", "e.g. i.e. etc.", "U.S.A.", "email@example.com",
    "https://example.com/path?query=1&b=2#frag", "C:\\Users\\me\\file.txt", "/usr/local/bin",
]
NUMBERS = [
    "3", "33", "333", "3333", "33333", "333333", "3333333", "12345678901234567890",
    "3.14159265358979", "1,000,000", "1e-10", "0xDEADBEEF", "-42", "+7", "2024-01-31",
    "12:34:56", "$1,234.56", "50%", "½ ¾ ⅓", "٠١٢٣٤٥٦٧٨٩", "०१२३४५६७८९", "１２３４５", "Ⅻ Ⅳ",
    "1st 2nd 3rd 4th", "v1.2.3-beta+exp.sha.5114f85", "3..3 3...3", "127.0.0.1:8080",
]
CJK = [
    "我想在apple工作1314151天～", "你好，世界！", "今天天气很好。我们去公园散步吧。",
    "机器学习是人工智能的一个分支", "東京は日本の首都です。", "ひらがなとカタカナ、漢字。",
    "ｶﾀｶﾅ半角", "안녕하세요, 세계!", "한국어 텍스트 처리는 재미있습니다.",
    "中文English混合text测试", "「引用」『二重』【括弧】", "《三体》刘慈欣",
    "繁體中文與简体中文", "𠀀𠀁𠀂 (CJK Extension B)",
]
SCRIPTS = [
    "нещо на Български", "Привет, мир!", "Ελληνικά γράμματα", "مرحبا بالعالم",
    "العربية: السلام عليكم", "שלום עולם", "עברית עם ניקוד: שָׁלוֹם", "नमस्ते दुनिया",
    "हिन्दी भाषा", "สวัสดีชาวโลก", "ภาษาไทยไม่มีช่องว่าง", "კარგი", "Բարեւ", "ሰላም",
    "កាន់តែពិសេសអាចខលចេញ", "ආයුබෝවන්", "Tiếng Việt có dấu", "Zażółć gęślą jaźń",
    "Ærøskøbing straße Ćevapčići", "Ꭰ Ꭱ Ꭲ Cherokee", "𝐀𝐁𝐂 𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "ﬁ ﬂ ligatures",
]
EMOJI = [
    "🦙", " this is 🦙.cpp", "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ (only emoji that has its own token)",
    "👨\u200d👩\u200d👧\u200d👦 family", "🏳️\u200d🌈 flag", "🇯🇵🇺🇸🇩🇪🇫🇷", "👍🏽👍🏿", "❤️‍🔥", "🧑🏻\u200d💻",
    "😁 ?", "☺️☹️", "#️⃣ *️⃣ 1️⃣", "🫠🫡", "🏴󠁧󠁢󠁳󠁣󠁴󠁿 Scotland",
]
SPECIAL = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_start|>user\nHi<|im_end|>",
    "text<|endoftext|>more text", "<|im_", "<|im_end", "<|im_start|", "|im_start|>",
    "<<|im_start|>>", "<|im_start|><|im_end|>", "<|endoftext|><|endoftext|>",
    "<tool_call>{\"name\": \"f\"}</tool_call>", "<think>not special in Qwen2.5</think>",
    "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>", "<|vision_start|><|image_pad|><|vision_end|>",
    "< |im_start| >", "<|IM_START|>", "x<|im_start|>y", " <|im_end|> ",
]
CODE = [
    "def f(x):\n    return x * 2\n",
    "for i in range(10):\n\tprint(i)\n",
    "class Foo:\n    def __init__(self):\n        self.x = {'a': [1, 2, 3]}\n",
    "#include <vector>\nint main() {\n  std::vector<int> v{1, 2, 3};\n  return v[0];\n}\n",
    "template <class T> T max(T a, T b) { return a > b ? a : b; }",
    "if (x != nullptr && *x >= 0) { x->y++; }",
    "{\"key\": \"value\", \"n\": 1.5e3, \"list\": [true, false, null]}",
    "SELECT * FROM users WHERE id = 42;",
    "    indented\n        more\n            most",
    "x+=1;y-=2;z*=3;w/=4;", "a<<=b>>=c", "=>", "->", "::", "===", "!==", "...", "/* c */ // c",
    "#!/usr/bin/env bash\nset -euo pipefail\necho \"$HOME\"\n",
    "------======= ''''''```````\"\"\"\"......!!!!!!??????",
]
WHITESPACE = [
    "", " ", "  ", "   ", "\t", "\n", "\n\n", "\n\n\n", "\t\n", "\r\n", "\r\n\r\n", "\r", " \r\n ",
    "    Hello", "    Hello\n    Hello", " (", "\n =", "' era", "a  b   c    d", "tab\tseparated\tvalues",
    "line1\r\nline2\r\nline3", "trailing   ", "   leading", " " * 40, "\t" * 12, "\n" * 9,
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n", "\u00a0nbsp\u00a0", "\u3000全角空格\u3000",
    "\u2003em\u2002en\u2009thin", "\u2028line sep\u2029para sep", "\x0bvt\x0cff",
]
ZERO_WIDTH = [
    "zero\u200bwidth", "zw\u200cnj", "zw\u200dj", "word\u2060joiner", "soft\u00adhyphen",
    "\u200b\u200b\u200b", "a\u200db", "e\u0301", "combining\u0300\u0301\u0302", "\u0301start",
]
# U+0085 (NEL) and U+FEFF are left out: Hugging Face's regex engine (Oniguruma) counts NEL as
# \s and U+FEFF not, JavaScript the other way round, so the reference cannot agree on them. The
# C++ unit tests pin the Hugging Face behaviour instead.
CONTROL = ["\x00", "a\x00b", "\x01\x02\x03", "\x7f", "bell\x07", "\x1b[31mred\x1b[0m"]

# Accented words, written in NFD below so that NFC has work to do.
ACCENTED = [
    "café", "naïve", "résumé", "Ångström", "piñata", "Übermensch", "São Paulo", "crème brûlée",
    "Dvořák", "Tiếng Việt", "한글", "がぎぐげご", "Ωμέγα",
]

ALL_FRAGMENTS = ENGLISH + NUMBERS + CJK + SCRIPTS + EMOJI + SPECIAL + CODE + WHITESPACE + ZERO_WIDTH + CONTROL

# Code point ranges sampled for random text: assigned long ago (so every engine's Unicode tables
# agree on their categories) and free of surrogates.
RANDOM_RANGES = [
    (0x20, 0x7E), (0xA0, 0x17F), (0x370, 0x3FF), (0x400, 0x4FF), (0x590, 0x5FF), (0x600, 0x6FF),
    (0x900, 0x97F), (0xE00, 0xE5B), (0x1100, 0x11FF), (0x2000, 0x206F), (0x2190, 0x23FF),
    (0x2500, 0x27BF), (0x3040, 0x30FF), (0x4E00, 0x9FA5), (0xAC00, 0xD7A3), (0xFF01, 0xFF9F),
    (0x1F300, 0x1F64F), (0x1D400, 0x1D7FF),
]


def random_text(rng, length):
    out = []
    for _ in range(length):
        lo, hi = rng.choice(RANDOM_RANGES)
        out.append(chr(rng.randint(lo, hi)))
    return "".join(out)


def random_separator(rng):
    return rng.choice(["", " ", "  ", "\n", "\t", "\r\n", " \n ", "   \n\n", ", ", ". ", "\u3000"])


def test_corpus(rng):
    strings = list(ALL_FRAGMENTS)
    strings += [unicodedata.normalize("NFD", w) for w in ACCENTED]
    strings += [unicodedata.normalize("NFD", w).upper() for w in ACCENTED]
    strings += [unicodedata.normalize("NFKD", w) for w in ACCENTED]
    # Contractions in every case combination, glued to words and standing alone.
    for c in ["s", "t", "re", "ve", "m", "ll", "d"]:
        for variant in sorted({c, c.upper(), c.capitalize(), c[::-1].capitalize()[::-1]}):
            strings += [f"it'{variant}", f"'{variant}", f"x '{variant} y", f"'{variant}'{variant}"]
    # Long words: runs of letters, digits and punctuation well past the BPE cache limit, so the
    # long-word merge path is checked too.
    strings += [
        "a" * 300, "ab" * 400, "supercalifragilisticexpialidocious" * 12, "9" * 500,
        "-" * 700, "!?" * 300, "我" * 400, "机器学习" * 120, "é" * 200,
        unicodedata.normalize("NFD", "é" * 150), "🦙" * 100, "x" + " " * 500 + "y", "\n" * 300,
        "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(3000)),
    ]
    # Whole paragraphs that mix every category.
    while len(strings) < 1100:
        parts = [rng.choice(ALL_FRAGMENTS) for _ in range(rng.randint(2, 8))]
        if rng.random() < 0.3:
            parts.append(random_text(rng, rng.randint(1, 40)))
        if rng.random() < 0.2:
            parts.append(unicodedata.normalize("NFD", rng.choice(ACCENTED)))
        strings.append("".join(p + random_separator(rng) for p in parts))
    for _ in range(150):
        strings.append(random_text(rng, rng.randint(1, 80)))
    return strings


WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but "
    "have an they you were her she there been one all we their can has more would if will no so "
    "when what about into than them only other new some could time these two may then do first "
    "any my now such like our over man me even most made after also did many before must through "
    "back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since "
    "against go came right used take three model training gradient memory tensor layer attention "
    "token sequence batch learning rate optimizer checkpoint precision throughput latency kernel"
).split()
CODE_LINES = [
    "def forward(self, x):", "    h = self.norm(x)", "    return self.proj(h) + x",
    "for (int64_t i = 0; i < n; ++i) {", "  out[i] = a[i] * b[i] + c;", "}",
    "import numpy as np", "x = np.zeros((batch, seq), dtype=np.float32)",
    "if err != nil {\n\treturn fmt.Errorf(\"read %s: %w\", path, err)\n}",
    "{\"id\": 17, \"name\": \"layer.0.weight\", \"shape\": [896, 4864]}",
]
CJK_POOL = "的一是不了人我在有他这为之大来以个中上们到说国和地也子时道出而要于就下得可你年生自会那后能对着事其里所去行过家十用发天如然作方成者多日都三小军二无同么经法当起与好看学进种将还分此心前面又定见只主没公从"
OTHER_POOL = ALL_FRAGMENTS


def bench_paragraph(rng):
    kind = rng.random()
    if kind < 0.6:
        sentences = []
        for _ in range(rng.randint(3, 12)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(5, 20))]
            words[0] = words[0].capitalize()
            if rng.random() < 0.2:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 100000)))
            if rng.random() < 0.15:
                words.insert(rng.randrange(len(words)), rng.choice(["don't", "it's", "we'll", "they've", "I'm"]))
            sentences.append(" ".join(words) + rng.choice([".", ".", ".", "?", "!", ";"]))
        return " ".join(sentences)
    if kind < 0.75:
        return "\n".join(rng.choice(CODE_LINES) for _ in range(rng.randint(4, 20))) + "\n"
    if kind < 0.9:
        return "".join(
            rng.choice(CJK_POOL) + ("，" if rng.random() < 0.08 else "") + ("。" if rng.random() < 0.04 else "")
            for _ in range(rng.randint(50, 300))
        )
    return " ".join(rng.choice(OTHER_POOL) for _ in range(rng.randint(5, 30)))


def bench_corpus(rng, size_mb):
    target = int(size_mb * 1_000_000)
    total = 0
    strings = []
    while total < target:
        s = bench_paragraph(rng)
        strings.append(s)
        total += len(s.encode("utf-8"))
    return strings


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="output file (default: standard output)")
    p.add_argument("--size-mb", type=float, help="write a benchmark corpus of about this many MB instead")
    p.add_argument("--seed", type=int, default=20240501)
    args = p.parse_args()
    rng = random.Random(args.seed)
    strings = bench_corpus(rng, args.size_mb) if args.size_mb else test_corpus(rng)
    text = "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in strings)
    if args.out:
        with open(args.out, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    print(f"make_tokenizer_corpus: {len(strings)} strings", file=sys.stderr)


if __name__ == "__main__":
    main()
