"""The prompt processor (titanlike/inference/processor.py): texts after BOS, conversations through the
chat template, LLaVA's images where its samples put them (placeholders and pixels), the stop ids of
each kind of prompt, and completions decoded with stop tokens and stop strings. Its users (generate,
serve, the lm-eval model, validation samples) are checked through their own tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from family_checks import materialize
from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data.chat_template import load_chat_template
from titanlike.data.images import ImageProcessor
from titanlike.inference import Engine, GenerationError, SamplingParams
from titanlike.inference.processor import Processor
from titanlike.models.registry import get_model_spec

LLAVA = get_model_spec("llava")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(DEFAULT_TOKENIZER_PATH)


@pytest.fixture(scope="module")
def llava(tokenizer):
    args = LLAVA.flavors["debugmodel"].update_from_config(vocab_size=tokenizer.vocab_size, seq_len=96)
    return materialize(LLAVA.model_cls, args, seed=1).eval()


def _image(seed: int, size=(36, 40)):
    from PIL import Image

    pixels = torch.randint(0, 256, (*size, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


def test_a_text_is_bos_and_its_tokens_and_stops_at_eos(tokenizer):
    processor = Processor(tokenizer)
    batch = processor(["In the beginning", ""])
    assert batch.ids == [[tokenizer.bos_id] + tokenizer.encode("In the beginning", bos=False, eos=False),
                         [tokenizer.bos_id]]
    assert batch.fields == {} and batch.stop_ids == {tokenizer.eos_id}
    with pytest.raises(GenerationError, match="no chat template"):
        processor([[{"role": "user", "content": "hi"}]])


def test_a_conversation_is_the_templates_generation_prompt_and_stops_at_the_end_of_turn(tokenizer):
    processor = Processor(tokenizer, template=load_chat_template("llama3", tokenizer))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    ids = processor.encode(messages)
    text = tokenizer.decode(ids)
    # Llama 3's format: the turns, then the assistant's header the answer follows.
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>")
    assert text.endswith("hello<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")
    assert processor.stop_ids(chat=True) == {tokenizer.eot_id, tokenizer.eos_id}
    # A batch of both kinds stops at either kind's stop tokens.
    assert processor(["plain", messages]).stop_ids == {tokenizer.eot_id, tokenizer.eos_id}
    assert processor(["plain"]).stop_ids == {tokenizer.eos_id}


def test_for_model_takes_the_familys_images_and_the_named_template(tokenizer, llava):
    processor = Processor.for_model(llava, tokenizer, chat_template="auto", option="--chat")
    v = llava.model_args.vision
    assert processor.images.image_token_id == llava.model_args.image_token_id
    assert processor.images.tokens_per_image == v.tokens_per_image == 16
    assert processor.image_processor == ImageProcessor.clip(v.image_size)
    assert processor.template is not None and "llama3" in processor.template.origin
    text_model = materialize(get_model_spec("llama3").model_cls,
                             dataclasses.replace(get_model_spec("llama3").flavors["debugmodel_tiny"],
                                                 vocab_size=tokenizer.vocab_size))
    plain = Processor.for_model(text_model, tokenizer)
    assert plain.images is None and plain.template is None
    with pytest.raises(GenerationError, match="Transformer takes no images"):
        plain.encode("What is it?", [_image(0)])
    with pytest.raises(GenerationError, match="--chat-template 'nothing.jinja' is neither"):
        Processor.for_model(text_model, tokenizer, chat_template="nothing.jinja")


def test_images_take_their_marks_or_come_first_with_their_pixels(tokenizer, llava):
    processor = Processor.for_model(llava, tokenizer)
    image, per = llava.model_args.image_token_id, 16
    a, b = _image(1), _image(2, size=(50, 30))
    words = lambda text: tokenizer.encode(text, bos=False, eos=False)  # noqa: E731
    batch = processor(["Compare <image> with <image>.", "What is it?", "Nothing to see"], [[a, b], [a], []])
    bos = tokenizer.bos_id
    assert batch.ids[0] == [bos] + words("Compare ") + [image] * per + words(" with ") + [image] * per + words(".")
    assert batch.ids[1] == [bos] + [image] * per + words("What is it?")  # no mark: the images first
    assert batch.ids[2] == [bos] + words("Nothing to see")
    # One row per prompt, as many images as the most a prompt has; a prompt's missing ones are zeros.
    pixels = batch.fields["pixel_values"]
    clip = ImageProcessor.clip(32)
    assert pixels.shape == (3, 2, 3, 32, 32)
    torch.testing.assert_close(pixels[0], torch.stack([clip(a), clip(b)]), rtol=0, atol=0)
    torch.testing.assert_close(pixels[1, 0], clip(a), rtol=0, atol=0)
    assert not pixels[1, 1].any() and not pixels[2].any()
    with pytest.raises(GenerationError, match=r"the prompt has 2 <image> mark\(s\) but 1 image\(s\)"):
        processor.encode("<image> and <image>", [a])
    with pytest.raises(GenerationError, match="2 prompts were given with 1 lists of images"):
        processor(["x", "y"], [[a]])
    # Without images a mark is text, as a text prompt is.
    assert processor.encode("<image>") == tokenizer.encode("<image>", bos=True, eos=False)


def test_a_conversations_images_open_its_first_user_turn(tokenizer, llava):
    processor = Processor.for_model(llava, tokenizer, chat_template="llama3")
    image, a = llava.model_args.image_token_id, _image(3)
    messages = [{"role": "system", "content": "Look."}, {"role": "user", "content": "What is it?"}]
    ids = processor.encode(messages, [a])
    start = ids.index(image)
    assert ids[start:start + 16] == [image] * 16 and ids.count(image) == 16
    # The placeholders follow the user's header, a line before the question.
    assert tokenizer.decode(ids[:start]).endswith("<|start_header_id|>user<|end_header_id|>\n\n")
    assert tokenizer.decode(ids[start + 16:]).startswith("\nWhat is it?<|eot_id|>")
    marked = [{"role": "user", "content": "What is <image> here?"}]
    ids = processor.encode(marked, [a])
    assert tokenizer.decode(ids[:ids.index(image)]).endswith("What is ")
    with pytest.raises(GenerationError, match="no user turn to hold the images"):
        processor.encode([{"role": "system", "content": "Look."}], [a])
    with pytest.raises(GenerationError, match="spells the image token"):
        processor.encode([{"role": "user", "content": "<|image|> itself"}], [a])


def test_a_batch_with_padded_images_answers_as_each_prompt_alone(tokenizer, llava):
    """The zeros a prompt with fewer images gets are unused: greedy answers in one batch equal each
    prompt's alone."""
    processor = Processor.for_model(llava, tokenizer)
    prompts, images = ["<image> or <image>?", "What is it?", "Plain text"], [[_image(4), _image(5)], [_image(6)], []]
    batch = processor(prompts, images)
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_token_ids=batch.stop_ids)
    engine = Engine(llava, start_id=processor.start_id)
    together, _ = engine.generate(batch.ids, params, fields=batch.fields)
    for prompt, own, completion in zip(prompts, images, together):
        alone = processor([prompt], [own])
        (want,), _ = engine.generate(alone.ids, params, fields=alone.fields)
        assert completion.tokens == want.tokens


def test_decode_ends_at_the_first_stop_token_and_the_earliest_stop_string(tokenizer):
    processor = Processor(tokenizer, template=load_chat_template("llama3", tokenizer))
    words = tokenizer.encode("one two three four", bos=False, eos=False)
    more = tokenizer.encode(" five", bos=False, eos=False)
    assert processor.decode(words) == "one two three four"
    # Default stops: EOS and the template's end of turn.
    assert processor.decode(words + [tokenizer.eot_id] + more) == "one two three four"
    assert processor.decode(words + [tokenizer.eos_id] + more) == "one two three four"
    # Stop ids given: only those (the others kept as text when special tokens are).
    assert processor.decode(words + [tokenizer.eot_id], stop_ids=frozenset({tokenizer.eos_id}),
                            skip_special_tokens=False) == "one two three four<|eot_id|>"
    assert processor.decode(words, stop_strings=("four", " two")) == "one"
    assert processor.decode(words, stop_strings=("", "five")) == "one two three four"


def test_the_engine_imports_neither_the_loader_nor_the_processor():
    """They import the engine (GenerationError, scores_only): read from the source, so an import inside
    a function counts, no module of the three imports one that imports it back."""
    import ast
    from pathlib import Path

    import titanlike.inference

    folder = Path(titanlike.inference.__file__).parent

    def imports(name: str) -> set[str]:
        tree = ast.parse((folder / f"{name}.py").read_text())
        found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        found |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        return {module.rpartition(".")[2] for module in found if module.startswith("titanlike.inference.")}

    assert imports("engine") == {"low_precision", "packed", "sampling"}
    assert imports("packed") == set()
    assert imports("low_precision") == set()
    assert "processor" not in imports("loading") and "engine" in imports("loading")
    assert {"engine", "loading"} <= imports("processor")


@pytest.mark.parametrize("source", ["ranks", "folder"])
def test_decode_leaves_out_special_tokens_as_transformers_does(tokenizer, source, tmp_path):
    """The text of ids that hold special tokens (a reserved one, BOS, end of turn, between and inside
    words) equals transformers' decode of the same ids with skip_special_tokens True and False,
    from the ranks file and from the Hugging Face folder it is exported as."""
    transformers = pytest.importorskip("transformers")
    from titanlike.data.hf_tokenizer import write_hf_tokenizer

    write_hf_tokenizer(str(tmp_path), DEFAULT_TOKENIZER_PATH)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    ours = tokenizer if source == "ranks" else build_tokenizer(str(tmp_path))
    processor = Processor(ours)
    reserved = ours.special_tokens["<|reserved_special_token_209|>"]
    words = ours.encode("Hello wor", bos=False, eos=False)
    rest = ours.encode("ld, and café", bos=False, eos=False)
    ids = [ours.bos_id, *words, reserved, *rest, tokenizer.eot_id, reserved, *words]
    for skip in (True, False):
        want = theirs.decode(ids, skip_special_tokens=skip)
        assert processor.decode(ids, stop_ids=frozenset(), skip_special_tokens=skip) == want, (source, skip)
    assert "reserved" not in processor.decode(ids, stop_ids=frozenset())
