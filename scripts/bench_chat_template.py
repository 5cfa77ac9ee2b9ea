"""How long a chat template takes to render one long conversation (issue 46: rendering was quadratic in turns).

    python scripts/bench_chat_template.py --turns 10000
    python scripts/bench_chat_template.py --turns 10000 --skip-whole-mask   # minutes less without tags

With the debug tokenizer and two templates: titanlike's llama3 (generation tags) and ChatML stripped
of its tags (each assistant turn found by re-rendering prefixes). Prints, per template, the time of
the whole conversation's ids and assistant mask (`tokenize_conversation`, what DPO pairs and
image-text rows take) and of one SFT row truncated to --seq-len (`tokenize_conversations`).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=10_000, help="turns of the conversation (user, assistant, ...)")
    parser.add_argument("--seq-len", type=int, default=2048, help="the SFT row's training.seq_len")
    parser.add_argument("--skip-whole-mask", action="store_true", help="time only the truncated SFT row for the "
                        "template without tags (its whole mask is quadratic in the turns)")
    args = parser.parse_args(argv)

    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.chat_template import CHATML_TEMPLATE, ChatTemplate, load_chat_template, tokenize_conversation
    from titanlike.data.conversations import tokenize_conversations

    tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} says something"}
                for i in range(args.turns)]
    tagged = load_chat_template("llama3", tok)
    plain = ChatTemplate(CHATML_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""),
                         "chatml without generation tags", tagged.variables)
    for name, template in (("llama3 (generation tags)", tagged), ("chatml without tags", plain)):
        whole = "skipped"
        if not (args.skip_whole_mask and template is plain):
            start = time.perf_counter()
            tokenize_conversation(template, tok, messages)
            whole = f"{time.perf_counter() - start:.2f} s"
        start = time.perf_counter()
        tokenize_conversations([("row 1", {"messages": messages})], template, tok, seq_len=args.seq_len)
        row = time.perf_counter() - start
        print(f"{args.turns} turns, {name}: whole mask {whole}; SFT row at seq_len {args.seq_len} {row:.2f} s",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
