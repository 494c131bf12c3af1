#!/usr/bin/env python3
"""Writes a deterministic `text`-format JSONL dataset for the benchmarks: COUNT examples of
500-509 random common English words. Each word is one Qwen2.5 token with its leading space and
memtune's text format appends the eos token, so an example is 501-510 tokens: max_length 512
deletes none. With MAX_LENGTH (default 512), MAX_LENGTH - 12 to MAX_LENGTH - 3 words: examples of
MAX_LENGTH - 11 to MAX_LENGTH - 2 tokens (512 gives the same file as no MAX_LENGTH).
Usage: make_bench_text.py OUT COUNT SEED [MAX_LENGTH]"""
import json
import random
import sys

WORDS = """the of and to in is it that was for on are as with his they at be this from have or by
one had not but what all were when we there can an your which their said if do will each about how
up out them then she many some so these would other into has more her two like him see time could
no make than first been its who now people my made over did down only way find use may water long
little very after words called just where most know get through back much go good new write our me
man too any day same right look think also around another came come work three word must because
does part even place well such here take why things help put years different away again off went
old number great tell men say small every found still between name should home big give air line
set own under read last never us left end along while might next sound below saw something thought
both few those always looked show large often together asked house world going want school
important until form food keep children feet land side without boy once animals life enough took
sometimes four head above kind began almost live page got earth need far hand high year mother
light parts country father let night following picture being study second eyes soon times story
boys since white days ever paper hard near sentence better best across during today others however
sure means knew try told young miles sun ways thing whole hear example heard several change answer
room sea against top turned learn point city play toward five using himself usually money seen car
morning river""".split()


def main(out, count, seed, max_length=512):
    if max_length < 16:
        sys.exit(f"make_bench_text: MAX_LENGTH {max_length} is under 16")
    rng = random.Random(seed)
    with open(out, "w") as f:
        for _ in range(count):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(max_length - 12, max_length - 3)))
            f.write(json.dumps({"text": text}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), *(int(a) for a in sys.argv[4:5]))
