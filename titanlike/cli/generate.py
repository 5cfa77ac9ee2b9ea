"""Generate text from a titanlike checkpoint (DCP, full or model-only) or a Hugging Face model folder.

    titanlike-generate outputs/checkpoint --prompt "In the beginning" --max-new-tokens 60
    titanlike-generate path/to/Llama-3.2-1B --tokenizer path/to/tokenizer.model --temperature 0
    titanlike-generate outputs/sft/checkpoint --chat --prompts-file questions.jsonl --batch-size 8
    titanlike-generate outputs/llava/checkpoint --image cat.png --prompt "<image> What is it?" --temperature 0
    titanlike-generate outputs/llava_sft/checkpoint --chat --image cat.png --prompt "What is it?"

(scripts/generate.py in a checkout.)

Decoding uses the model's KV cache (titanlike/inference): the prompts are prefilled in one pass,
then one token per step; prompts of different lengths share a batch (--batch-size). Sampling:
repetition penalty, temperature, top-k, top-p (temperature 0 is greedy); a continuation ends at a
stop token (the tokenizer's EOS, the chat template's end of turn, --stop-token), a stop string
(--stop), --max-new-tokens, or the model's context. One prompt at a time (the default) is streamed
as it is generated; the speed (tokens/s, time to first token) goes to stderr.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from titanlike.inference.arguments import add_model_arguments


def __getattr__(name: str):
    # The loader's helpers, importable from here as before (scripts/generate.py re-exports them), imported
    # when asked for: `titanlike-generate --help` imports no torch.
    if name in ("training_objective", "vocab_size"):
        from titanlike.inference import loading

        return getattr(loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def generate(model, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int | None,
             eos_id: int | set[int] | None, generator=None, seed: int | None = None) -> list[int]:
    """The prompt's continuation (new token ids only, ending at eos_id: a token or a set of them),
    through the KV-cache engine. `generator` is accepted for older callers and unused (seed it is)."""
    from titanlike.inference import Engine, SamplingParams

    stops = set() if eos_id is None else ({eos_id} if isinstance(eos_id, int) else set(eos_id))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k or 0,
                            stop_token_ids=frozenset(stops), seed=seed)
    (completion,), _ = Engine(model).generate([prompt_ids], params)
    return completion.tokens


def _read_prompts_file(path: str, *, chat: bool) -> list:
    """Prompts from a JSONL file: each line a JSON string, an object with "prompt" (text), or in chat
    mode one with "messages" (a conversation the model answers). ValueError, one sentence, else."""
    prompts = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--prompts-file {path} cannot be read: {e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"--prompts-file {path} line {number} is not JSON") from None
        if isinstance(item, dict) and chat and isinstance(item.get("messages"), list):
            prompts.append(item["messages"])
        elif isinstance(item, dict) and isinstance(item.get("prompt"), str):
            prompts.append(item["prompt"])
        elif isinstance(item, str):
            prompts.append(item)
        else:
            want = 'a string, {"prompt": text}' + (' or {"messages": [...]}' if chat else "")
            raise ValueError(f"--prompts-file {path} line {number} is not {want}")
    if not prompts:
        raise ValueError(f"--prompts-file {path} holds no prompt")
    return prompts


def _sampling_error(e: ValueError) -> str:
    """SamplingParams names its fields (top_p); the user typed the options (--top-p)."""
    name, _, rest = str(e).partition(" ")
    return f"--{name.replace('_', '-')} {rest}"


def _parser(prog: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    add_model_arguments(parser, compile_shapes="every batch's cache holds the longest prompt + --max-new-tokens")
    parser.add_argument("--prompt", action="append", help="prompt text (repeat for several); default: a BOS only")
    parser.add_argument("--prompts-file", default=None, help="a JSONL file of prompts: per line a JSON string or "
                        '{"prompt": text} (with --chat also {"messages": [...]})')
    parser.add_argument("--chat", action="store_true", help="each prompt is a user turn, rendered with the "
                        "tokenizer's chat template (titanlike's llama3 template if it has none), the answer "
                        "ending at the end of the assistant's turn (models fine-tuned with training.objective sft)")
    parser.add_argument("--image", action="append", default=[], help="an image file (repeat for several) given with "
                        "every prompt to a vision-language model: each <image> in the prompt takes the next one, or "
                        "all come before the text when it has none (with --chat: the first user turn's)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=50, help="0 means no top-k filtering")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling; 1 means no filtering")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages tokens already in "
                        "the sequence (as transformers' repetition_penalty); 1 means none")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat for several): the "
                        "text ends before it")
    parser.add_argument("--stop-token", action="append", type=int, default=[], help="a stop token id (repeat for "
                        "several), besides the tokenizer's EOS")
    parser.add_argument("--batch-size", type=int, default=1, help="prompts decoded together; 1 streams the text "
                        "as it is generated")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _request(args: argparse.Namespace):
    """(prompts, SamplingParams) the options ask for, --chat's texts as user turns; GenerationError,
    one sentence, for options that ask for nothing sensible."""
    from titanlike.inference import GenerationError, SamplingParams

    if args.batch_size < 1:
        raise GenerationError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.prompt is not None and any(p == "" for p in args.prompt):
        raise GenerationError("--prompt is empty: give some text, or leave --prompt out to sample from a BOS token "
                              "alone")
    try:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                                stop_strings=tuple(args.stop), stop_token_ids=frozenset(args.stop_token),
                                seed=args.seed)
    except ValueError as e:
        raise GenerationError(_sampling_error(e)) from None
    prompts: list = list(args.prompt or [])
    if args.prompts_file:
        try:
            prompts += _read_prompts_file(args.prompts_file, chat=args.chat)
        except ValueError as e:
            raise GenerationError(str(e)) from None
    prompts = prompts or [""]
    if args.chat:
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    return prompts, params


def _read_images(paths: list[str]) -> list:
    """The --image files as RGB PIL images; GenerationError, one sentence, for one that is no image."""
    from titanlike.inference import GenerationError

    images = []
    for path in paths:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (OSError, UnidentifiedImageError) as e:
            raise GenerationError(f"--image {path} cannot be read as an image: {e}") from None
    return images


def _encode(processor, prompts: list, images: list) -> list[list[int]]:
    """Every prompt's token ids with the images (the processor's); GenerationError, one sentence."""
    from titanlike.inference import GenerationError

    try:
        return [processor.encode(prompt, images) for prompt in prompts]
    except ValueError as e:
        raise GenerationError(str(e)) from None
    except Exception as e:  # a chat template that refuses the messages, a hostile file's content
        raise GenerationError(f"a prompt cannot be encoded: {type(e).__name__}: {e}") from None


def _label(prompt) -> str:
    """What is printed of a prompt: its text, or the last turn of a conversation."""
    return prompt if isinstance(prompt, str) else prompt[-1].get("content", "") if prompt else ""


def _print_completions(engine, processor, prompts: list, ids: list, images: list, params, args) -> None:
    """Generate batch after batch and print each prompt with its continuation (streamed when a batch
    holds one prompt), then the speed on stderr."""
    total_new, total_time, first_token = 0, 0.0, []
    for start in range(0, len(ids), args.batch_size):
        batch, texts = ids[start:start + args.batch_size], prompts[start:start + args.batch_size]
        streaming = len(batch) == 1
        if streaming:
            print(f"{_label(texts[0])}\n> " if args.chat else _label(texts[0]), end="", flush=True)
        on_text = (lambda row, text: print(text, end="", flush=True)) if streaming else None
        completions, stats = engine.generate(
            batch, params, detokenize=lambda t: processor.decode(t, stop_ids=params.stop_token_ids), on_text=on_text,
            fields=processor.image_fields([images] * len(batch)))  # every prompt has the same images
        for prompt, completion in zip(texts, completions):
            if streaming:
                print()
            else:
                print(f"{_label(prompt)}\n> {completion.text}" if args.chat else _label(prompt) + completion.text)
        total_new += stats.new_tokens
        total_time += stats.total_time
        first_token.append(stats.time_to_first_token)
    print(f"[{total_new} new tokens in {total_time:.2f} s: {total_new / max(total_time, 1e-9):.1f} tokens/s; first "
          f"token after {1000 * sum(first_token) / len(first_token):.0f} ms on average]", file=sys.stderr)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    args = _parser(prog).parse_args(argv)
    from titanlike.inference import Engine, GenerationError
    from titanlike.inference.loading import load_model_arguments, one_process
    from titanlike.inference.processor import Processor

    try:
        one_process("titanlike-generate")
        prompts, params = _request(args)
        model, tokenizer = load_model_arguments(args)
        bad_stop = [t for t in args.stop_token if t >= tokenizer.vocab_size]
        if bad_stop:
            raise GenerationError(f"--stop-token {bad_stop[0]} is not a token id of the model's vocabulary of "
                                  f"{tokenizer.vocab_size}")
        processor = Processor.for_model(model, tokenizer, checkpoint=args.checkpoint,
                                        chat_template="auto" if args.chat else None, option="--chat")
        images = _read_images(args.image)
        ids = _encode(processor, prompts, images)
        stops = processor.stop_ids(chat=args.chat) | params.stop_token_ids
        params = dataclasses.replace(params, stop_token_ids=stops)
        # Compiled, one cache length for every batch (a graph per length otherwise).
        context = min(model.model_args.context_len, max(map(len, ids)) + args.max_new_tokens) if args.compile else None
        engine = Engine(model, start_id=processor.start_id, compile=args.compile, context_len=context)
        engine.check_prompts(ids)
        _print_completions(engine, processor, prompts, ids, images, params, args)
    except GenerationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def console_main() -> None:
    """The `titanlike-generate` console script."""
    sys.exit(main(prog="titanlike-generate"))
