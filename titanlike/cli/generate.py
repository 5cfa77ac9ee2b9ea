"""Generate text from a titanlike checkpoint (DCP, full or model-only) or a Hugging Face model folder.

    titanlike-generate outputs/checkpoint --prompt "In the beginning" --max-new-tokens 60
    titanlike-generate path/to/Llama-3.2-1B --tokenizer path/to/tokenizer.model --temperature 0

(scripts/generate.py in a checkout.)

A sanity check of a trained model, not an inference server: one prompt at a time and no
KV cache (every new token reruns the whole sequence, as torchtitan's generation test does),
which is fine for the debug and small models and slow for large ones. Sampling is
temperature + top-k; temperature 0 is greedy. Stops at max-new-tokens, at the tokenizer's
EOS, or at the model's context length.
"""

from __future__ import annotations

import argparse
import sys

import torch


def _logits(output) -> torch.Tensor:
    """The logits of a forward (a family may return them beside auxiliary losses)."""
    from titanlike.models.outputs import logits_of

    return logits_of(output)


@torch.no_grad()
def vocab_size(model) -> int:
    """The model's vocabulary: the last dimension of its logits for one token."""
    device = next(model.parameters()).device
    return _logits(model(torch.zeros(1, 1, dtype=torch.long, device=device))).shape[-1]


@torch.no_grad()
def generate(model, prompt_ids: list[int], *, max_new_tokens: int, temperature: float, top_k: int | None,
             eos_id: int | set[int] | None, generator=None) -> list[int]:
    """The prompt's continuation (new token ids only), ending at eos_id (a token or a set of them)."""
    device = next(model.parameters()).device
    context = model.model_args.context_len
    tokens = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    new: list[int] = []
    for _ in range(max_new_tokens):
        if tokens.shape[1] >= context:
            break
        logits = _logits(model(tokens))[0, -1].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        new.append(next_id)
        if next_id == eos_id or (isinstance(eos_id, (set, frozenset)) and next_id in eos_id):
            break
        tokens = torch.cat([tokens, tokens.new_tensor([[next_id]])], dim=1)
    return new


def training_objective(model):
    """The objective the model's family trains with (its ModelSpec's, for these args)."""
    from titanlike.config import JobConfig
    from titanlike.models.registry import get_model_spec, model_names

    spec = next(get_model_spec(name) for name in model_names() if get_model_spec(name).model_cls is type(model))
    return spec.objective(JobConfig(), model.model_args)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="DCP step folder, checkpoint folder (latest step), or HF folder")
    parser.add_argument("--prompt", action="append", help="prompt text (repeat for several); default: a BOS only")
    parser.add_argument("--tokenizer", default=None, help="tiktoken file or Hugging Face tokenizer folder; default: "
                        "the checkpoint folder's tokenizer.json if it has one, else the debug tokenizer")
    parser.add_argument("--chat", action="store_true", help="each prompt is a user turn, rendered with the "
                        "tokenizer's chat template (titanlike's llama3 template if it has none), the answer "
                        "ending at the end of the assistant's turn (models fine-tuned with training.objective sft)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=50, help="0 means no top-k filtering")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="default: as stored")
    args = parser.parse_args(argv)

    from titanlike.checkpoint import CheckpointError, load_model
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer

    import os

    from titanlike.data.tokenizer_json import is_tokenizer_folder

    own = args.checkpoint if os.path.isdir(args.checkpoint) and is_tokenizer_folder(args.checkpoint) else None
    tokenizer = build_tokenizer(args.tokenizer or own or DEFAULT_TOKENIZER_PATH)
    try:
        model = load_model(args.checkpoint, args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    objective = training_objective(model)
    if not objective.predicts_next_token:
        print(f"error: this script samples next tokens from decoder-only models; {type(model).__name__} was trained "
              f"on {objective.name} samples (load it with titanlike.load_model and call it, or export it to "
              "Hugging Face)", file=sys.stderr)
        return 1
    vocab = vocab_size(model)
    if tokenizer.vocab_size != vocab:
        print(f"error: the tokenizer has {tokenizer.vocab_size} tokens but the model {vocab}; pass the tokenizer "
              "it was trained with (--tokenizer)", file=sys.stderr)
        return 1
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    stops = {tokenizer.eos_id}
    if args.chat:
        from titanlike.data.chat_template import chat_prompt_ids, end_of_turn_ids, load_chat_template
        from titanlike.data.errors import DataError

        try:
            template = load_chat_template("auto", tokenizer, option="--chat")
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        stops = end_of_turn_ids(template, tokenizer)
    for prompt in args.prompt or [""]:
        if args.chat:
            ids = chat_prompt_ids(template, tokenizer, [{"role": "user", "content": prompt}])
        else:
            ids = tokenizer.encode(prompt, bos=True, eos=False)
        new = generate(model, ids, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k or None, eos_id=stops, generator=generator)
        answer = tokenizer.decode([t for t in new if t not in stops])
        print(f"{prompt}\n> {answer}" if args.chat else prompt + answer)
    return 0


def console_main() -> None:
    """The `titanlike-generate` console script."""
    sys.exit(main(prog="titanlike-generate"))
