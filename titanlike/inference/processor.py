"""Requests become model inputs here, and completions text: the one processor that titanlike-generate,
titanlike-serve, the lm-evaluation-harness model (harness.py) and validation's samples
(train/evaluate.py Samples) share, and that RL rollouts take next.

A Processor holds what a prompt needs beside the model: the tokenizer, the chat template (for
conversations), the family's image inputs (ModelSpec.images: the placeholder token, the tokens per
image, the tower's pixel preprocessing of data/images.py), the stop ids (EOS for text, the
template's end of turn for chat), an encoder-decoder's decoder start token, and the ids a text prompt
is framed with: those the tokenizer folder's own files apply (transformers' `tokenizer(text)`), else
the family's exported tokenizer's (HFAdapter.tokenizer_template: Llama BOS first, GPT-2 nothing, T5
EOS last), so that a prompt gives the same tokens as transformers on the export. Processor.for_model
takes them from a loaded checkpoint (inference/loading.py) and its family's spec.

    processor = Processor.for_model(model, tokenizer, checkpoint=path, chat_template="auto")
    batch = processor(["In the beginning", [{"role": "user", "content": "<image> What is it?"}]],
                      images=[[], [cat]])
    completions, _ = Engine(model, start_id=processor.start_id).generate(
        batch.ids, SamplingParams(stop_token_ids=batch.stop_ids), fields=batch.fields)
    texts = [processor.decode(c.tokens, stop_ids=batch.stop_ids) for c in completions]

Images go where the training samples put them (data/image_captions.py, data/image_text.py): each
`<image>` mark of a prompt takes the next image; a text without marks gets its images first, a
conversation without marks at the start of its first user turn, a line before the text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from titanlike.data.image_text import IMAGE_MARK
from titanlike.inference.engine import GenerationError

# A prompt: a text, or a conversation (a list of {"role", "content"} messages) the model answers.
Prompt = str | Sequence[dict]


@dataclass
class PromptBatch:
    """Prompts as Engine.generate takes them: each prompt's token ids, the prefill's other inputs (one
    row per prompt: pixel_values), and the tokens that end their answers."""

    ids: list[list[int]]
    fields: dict[str, torch.Tensor]
    stop_ids: frozenset[int]


class Processor:
    """Prompts -> token ids and the prefill's inputs; completions' tokens -> text (module docstring)."""

    def __init__(self, tokenizer, *, template=None, images=None, start_id: int | None = None,
                 model_name: str = "the model", framing=None, eos_ids: frozenset[int] | None = None):
        """template: a data/chat_template.py ChatTemplate (None: text prompts only). images: the
        family's image inputs (models/registry.py ImageInputs; None: a text model). start_id: the
        decoder start token of an encoder-decoder (None: the model's default). model_name: the model
        in messages. framing: the ids around a text prompt (data/tokenizer_json.py Framing; None: the
        tokenizer's own, else BOS first). eos_ids: the tokens that end a text's answer (None: the
        tokenizer's EOS; titanlike-serve gives a Hugging Face folder's generation_config.json ones)."""
        from titanlike.data.chat_template import end_of_turn_ids
        from titanlike.data.errors import DataError
        from titanlike.data.images import ImageProcessor

        self.tokenizer, self.template, self.images = tokenizer, template, images
        # The tower's preprocessing of an image's pixels (resize, crop, normalization).
        self.image_processor = None if images is None else ImageProcessor.of_tower(images.processor, images.image_size)
        self.start_id, self.model_name = start_id, model_name
        self.framing = framing or prompt_framing(tokenizer, None)
        if eos_ids is None:
            eos_ids = frozenset() if tokenizer.eos_id is None else frozenset({tokenizer.eos_id})
        self.eos_ids = frozenset(eos_ids)
        # Read once: a tokenizer builds the set anew at each read, and a server's decode of every row
        # at every step read it (4% of a 16-client step's CPU, scripts/bench_serve.py).
        self.special_ids = tokenizer.special_ids
        try:
            self.end_of_turn_ids = None if template is None else frozenset(end_of_turn_ids(template, tokenizer))
        except DataError as e:
            raise GenerationError(str(e)) from None

    @classmethod
    def for_model(cls, model: nn.Module, tokenizer, *, checkpoint: str | None = None,
                  chat_template: str | None = None, option: str = "--chat-template",
                  eos_ids: frozenset[int] | None = None) -> Processor:
        """The processor of a loaded model: its family's image inputs; the decoder start token recorded
        with `checkpoint` (loading.py decoder_start_id; without one, the tokenizer's pad token); the
        chat template `chat_template` names (data/chat_template.py load_chat_template: "auto", a
        builtin name or a Jinja file; None: no chat), `option` naming it in messages; eos_ids as in
        __init__.
        GenerationError, one sentence, for a template or start token that cannot be had."""
        from titanlike.data.chat_template import load_chat_template
        from titanlike.data.errors import DataError
        from titanlike.inference.loading import decoder_start_id, model_spec, pad_start_id

        spec = model_spec(model)
        images = spec.images(model.model_args) if spec is not None and spec.images is not None else None
        start_id = decoder_start_id(checkpoint, tokenizer, model) if checkpoint else pad_start_id(tokenizer)
        try:
            template = None if chat_template is None else load_chat_template(chat_template, tokenizer, option=option)
        except DataError as e:
            raise GenerationError(str(e)) from None
        return cls(tokenizer, template=template, images=images, start_id=start_id, model_name=type(model).__name__,
                   framing=prompt_framing(tokenizer, spec), eos_ids=eos_ids)

    # Prompts -> inputs ------------------------------------------------------------------------

    def __call__(self, prompts: Sequence[Prompt], images: Sequence[Sequence] | None = None) -> PromptBatch:
        """A batch of prompts (texts or conversations) with their images (one list per prompt, PIL
        images; None: none) as the engine takes them. GenerationError, one sentence, for images a
        prompt cannot take; a chat template's own exceptions propagate."""
        images = [()] * len(prompts) if images is None else images
        if len(images) != len(prompts):
            raise GenerationError(f"{len(prompts)} prompts were given with {len(images)} lists of images")
        ids = [self.encode(prompt, own) for prompt, own in zip(prompts, images)]
        stops = frozenset().union(*(self.stop_ids(chat=not isinstance(p, str)) for p in prompts))
        return PromptBatch(ids, self.image_fields(images), stops)

    def stop_ids(self, *, chat: bool) -> frozenset[int]:
        """The tokens that end an answer: the template's end of turn for a conversation, EOS for a text."""
        if not chat:
            return self.eos_ids
        if self.end_of_turn_ids is None:
            raise GenerationError("a conversation was given but the processor has no chat template")
        return self.end_of_turn_ids

    def encode(self, prompt: Prompt, images: Sequence = ()) -> list[int]:
        """One prompt's token ids: a text framed as the export's tokenizer frames it (an empty text: BOS
        alone, what to sample from), a conversation rendered by the chat template with
        its generation prompt; with images, each an image's placeholder tokens where the module
        docstring says (their pixels: image_fields). GenerationError, one sentence, for marks and
        images that do not pair up or images a text model cannot take."""
        chat = not isinstance(prompt, str)
        if chat and self.template is None:
            raise GenerationError("a conversation was given but the processor has no chat template")
        if images and self.images is None:
            raise GenerationError(f"{self.model_name} takes no images: it reads text only")
        if not images:  # a mark without an image is the model's text to read
            if chat:
                from titanlike.data.chat_template import chat_prompt_ids

                return chat_prompt_ids(self.template, self.tokenizer, prompt)
            before, after = self.framing
            ids = list(before) + self.tokenizer.encode(prompt, bos=False, eos=False) + list(after)
            return ids or [self.tokenizer.bos_id]
        return self._chat_with_images(prompt, len(images)) if chat else self._text_with_images(prompt, len(images))

    def image_fields(self, images: Sequence[Sequence]) -> dict[str, torch.Tensor]:
        """The prefill's inputs for each prompt's images (a list per prompt): pixel_values (prompts,
        most images, C, H, W), a prompt's missing images zeros (the model's splice leaves images
        without placeholders unused); nothing when no prompt has one."""
        most = max((len(own) for own in images), default=0)
        if most == 0:
            return {}
        if self.images is None:
            raise GenerationError(f"{self.model_name} takes no images: it reads text only")
        pixels = [[self.image_processor(image) for image in own] for own in images]
        shape = next(p for own in pixels for p in own).shape
        return {"pixel_values": torch.stack([torch.stack(own + [torch.zeros(shape)] * (most - len(own)))
                                             for own in pixels])}

    def _text_with_images(self, text: str, count: int) -> list[int]:
        """The text with each mark an image's placeholders (no marks: the images first, as the caption
        samples put them), framed as a text is."""
        pieces = text.split(IMAGE_MARK)
        marks = len(pieces) - 1
        if marks and marks != count:
            raise GenerationError(f"the prompt has {marks} {IMAGE_MARK} mark(s) but {count} image(s) were given")
        if not marks:
            pieces = [""] * count + [text]
        ids = list(self.framing.before)
        for i, piece in enumerate(pieces):
            if i:
                ids += [self.images.image_token_id] * self.images.tokens_per_image
            if piece:
                ids += self.tokenizer.encode(piece, bos=False, eos=False)
        return ids + list(self.framing.after)

    def _chat_with_images(self, messages: Sequence[dict], count: int) -> list[int]:
        """The conversation rendered with each mark of its turns the image token, then each image token
        expanded to its placeholders, as the conversation samples are (data/image_text.py)."""
        from titanlike.data.chat_template import chat_prompt_ids
        from titanlike.data.image_text import expand_images, image_token_text

        marks = sum(str(m.get("content", "")).count(IMAGE_MARK) for m in messages)
        if marks and marks != count:
            raise GenerationError(f"the conversation has {marks} {IMAGE_MARK} mark(s) but {count} image(s) were "
                                  "given")
        messages = [dict(m) for m in messages]
        if not marks:  # LLaVA's place: the first user turn, a line before its text
            user = next((m for m in messages if m.get("role") == "user"), None)
            if user is None:
                raise GenerationError("the conversation has no user turn to hold the images")
            user["content"] = IMAGE_MARK * count + "\n" + str(user.get("content", ""))
        token_id = self.images.image_token_id
        token = image_token_text(self.tokenizer, token_id)
        messages = [{**m, "content": str(m.get("content", "")).replace(IMAGE_MARK, token)} for m in messages]
        ids = chat_prompt_ids(self.template, self.tokenizer, messages)
        if ids.count(token_id) != count:
            raise GenerationError(f"the conversation's text spells the image token {token} itself; write "
                                  f"{IMAGE_MARK} where an image goes")
        ids, _ = expand_images(ids, [False] * len(ids), token_id, self.images.tokens_per_image)
        return ids

    # Completions -> text ----------------------------------------------------------------------

    def decode(self, tokens: Sequence[int], *, stop_ids: frozenset[int] | None = None,
               stop_strings: Sequence[str] = (), skip_special_tokens: bool = True) -> str:
        """A completion's text: its tokens before the first stop token (stop_ids; default: EOS and,
        with a template, its end of turn), cut before the earliest stop string, without the special
        tokens (the tokenizer's special_ids) unless skip_special_tokens is False: transformers'
        decode(skip_special_tokens=True), which also drops them before decoding the rest. Also the
        engine's detokenizer of a row's tokens so far (Engine.generate's detokenize)."""
        stops = stop_ids if stop_ids is not None else self.eos_ids | (self.end_of_turn_ids or frozenset())
        end = next((i for i, token in enumerate(tokens) if token in stops), len(tokens))
        kept = list(tokens[:end])
        if skip_special_tokens:
            kept = [token for token in kept if token not in self.special_ids]
        text = self.tokenizer.decode(kept)
        found = [at for at in (text.find(stop) for stop in stop_strings if stop) if at >= 0]
        return text[:min(found)] if found else text


def prompt_framing(tokenizer, spec):
    """The ids around a text prompt: the tokenizer's own (a Hugging Face folder's post-processor), else
    those the family's exported tokenizer applies (spec.hf.tokenizer_template; no spec: BOS first, as
    titanlike trains)."""
    from titanlike.data.errors import DataError
    from titanlike.data.hf_tokenizer import DEFAULT_TEMPLATE, template_framing
    from titanlike.data.tokenizer_json import Framing

    if tokenizer.framing is not None:
        return tokenizer.framing
    template = spec.hf.tokenizer_template[0] if spec is not None and spec.hf is not None else DEFAULT_TEMPLATE[0]
    try:
        return template_framing(tokenizer, template)
    except DataError:  # a role the tokenizer has no token for (BERT's cls): BOS first
        return Framing((tokenizer.bos_id,), ())


__all__ = ["Processor", "PromptBatch", "prompt_framing"]
