#!/usr/bin/env python
"""Compose a LLaVA Hugging Face folder from a pretrained vision tower and a language model in separate
folders, with a freshly initialized projector: the starting point of LLaVA's stage 1.

    python scripts/compose_llava.py --vision path/to/clip-vit-large-patch14-336 \\
        --language path/to/vicuna-7b --image_token_id 32000 --out llava_start
    python train.py --model.name llava --checkpoint.enable --checkpoint.initial_load_path llava_start \\
        --checkpoint.initial_load_in_hf --llava.freeze vision_tower,language_model ...

The tower's folder holds a CLIPVisionModel or SiglipVisionModel (or a whole CLIPModel / SiglipModel:
its vision half is taken); the language model's folder a causal LM one of titanlike's families reads.
The image token must be one of the language model's tokens that text never produces (a special token).
The output is a LlavaForConditionalGeneration folder (transformers loads it too), with the language
folder's tokenizer when it has one.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="compose_llava.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vision", required=True, help="Hugging Face folder of the vision tower (CLIP or SigLIP)")
    parser.add_argument("--language", required=True, help="Hugging Face folder of the causal language model")
    parser.add_argument("--out", required=True, help="the LLaVA folder to write")
    parser.add_argument("--image_token_id", type=int, required=True, help="the <image> placeholder token id")
    parser.add_argument("--vision_feature_layer", type=int, default=-2,
                        help="the tower layer whose output LLaVA reads (-2: LLaVA-1.5's)")
    parser.add_argument("--select", choices=("default", "full"), default=None,
                        help="default: drop the first token (CLIP's class token); full: keep all "
                             "(default: default for CLIP, full for SigLIP)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the projector's initialization")
    a = parser.parse_args(argv)

    from titanlike.checkpoint.format import CheckpointError
    from titanlike.checkpoint.hf import read_hf, write_hf
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llava")
    try:
        vision_sd, vision_config = read_hf(a.vision)
        text_sd, text_config = read_hf(a.language)
        args, hf_sd = spec.hf.compose(vision_config, vision_sd, text_config, text_sd, image_token_id=a.image_token_id,
                                      feature_layer=a.vision_feature_layer, select=a.select)
        args.validate(_one_process(), seq_len=1)
        import torch

        with torch.device("meta"):
            model = spec.model_cls(args)
        model.to_empty(device="cpu")
        model.init_weights(seed=a.seed)  # the projector's values; the rest is overwritten below
        state = model.state_dict()
        loaded = spec.hf.from_hf_state_dict(hf_sd, args)
        missing = sorted(set(state) - set(loaded) - {k for k in state if k.startswith("projector.")})
        if missing:
            raise CheckpointError(f"the two folders lack {missing[0]} (and {len(missing) - 1} more)")
        state.update({k: v for k, v in loaded.items() if k in state})
        has_tokenizer = any(os.path.isfile(os.path.join(a.language, f)) for f in ("tokenizer.json", "tokenizer.model"))
        export = write_hf(state, spec, args, a.out, tokenizer_path=a.language if has_tokenizer else None,
                          bos_id=text_config.get("bos_token_id"), eos_id=text_config.get("eos_token_id"))
    except (CheckpointError, KeyError, ValueError) as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) else e}", file=sys.stderr)
        return 2
    print(f"wrote {a.out}: {args.vision.kind} tower of {args.vision.n_layers} layers, {args.language_model} language "
          f"model, a new projector (seed {a.seed})")
    if export.message:
        print(f"compose_llava: note: {export.message}", file=sys.stderr)
    return 0


def _one_process():
    from types import SimpleNamespace

    return SimpleNamespace(tp=1, cp=1, pp=1, ep=1)


if __name__ == "__main__":
    sys.exit(main())
