"""LLaVA learns to look (issue 31 item 6): images drawn with PIL by the test (one to three shapes of one
kind and one color), a question about each (its color, its shape or how many) with one exact answer.
The debug model trains in-process on a CPU budget; exact-match accuracy of its greedy answers on
held-out images, generated through the inference engine (the prefill takes the images, the language
model's KV cache decodes), rises clearly. The questions alone cannot give it: the answer to each is
one of three or four words drawn uniformly, so a model blind to the image stays near 1/3."""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.nn.functional as F

from family_checks import materialize
from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.inference import Engine, SamplingParams
from titanlike.inference.processor import Processor
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.models.registry import get_model_spec
from titanlike.objectives.registry import family_objective

COLORS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (230, 210, 30)}
SHAPES = ("circle", "square", "triangle")
COUNTS = ("one", "two", "three")
QUESTIONS = {"color": "<image>What color?", "shape": "<image>What shape?", "count": "<image>How many?"}


def scene(rng: np.random.Generator):
    """(32x32 PIL image, {question kind: answer word}): 1 to 3 shapes of one kind and color, each in its
    own quarter of the image (2x2 of the tower's 8x8 patches)."""
    from PIL import Image, ImageDraw

    color, shape, count = (list(COLORS)[rng.integers(4)], SHAPES[rng.integers(3)], int(rng.integers(1, 4)))
    image = Image.new("RGB", (32, 32), (128, 128, 128))
    draw = ImageDraw.Draw(image)
    for quarter in rng.permutation(4)[:count]:
        left, top = int(quarter % 2) * 16 + 1, int(quarter // 2) * 16 + 1
        box = (left, top, left + 13, top + 13)
        if shape == "circle":
            draw.ellipse(box, fill=COLORS[color])
        elif shape == "square":
            draw.rectangle(box, fill=COLORS[color])
        else:
            draw.polygon([(left, top + 13), (left + 13, top + 13), (left + 6, top)], fill=COLORS[color])
    return image, {"color": color, "shape": shape, "count": COUNTS[count - 1]}


def examples(processor, seed: int, n: int):
    """n (prompt ids, pixel_values (1, 1, C, H, W), answer word), one random question per image."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        image, answers = scene(rng)
        kind = list(QUESTIONS)[rng.integers(3)]
        batch = processor([QUESTIONS[kind]], [[image]])
        out.append((batch.ids[0], batch.fields["pixel_values"], answers[kind], image, QUESTIONS[kind]))
    return out


def training_batch(batch, tokenizer):
    """(tokens, labels, pixel_values): prompt + " answer" + EOS, right-padded; the loss on the answer only."""
    rows = [(ids, tokenizer.encode(" " + answer, bos=False, eos=False) + [tokenizer.eos_id])
            for ids, _, answer, *_ in batch]
    length = max(len(p) + len(a) for p, a in rows)
    tokens = torch.full((len(rows), length), tokenizer.eos_id)
    labels = torch.full((len(rows), length), IGNORE_INDEX)
    for row, (prompt, answer) in enumerate(rows):
        tokens[row, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        labels[row, len(prompt) - 1:len(prompt) + len(answer) - 1] = torch.tensor(answer)
    return tokens, labels, torch.cat([example[1] for example in batch])


def accuracy(model, held_out, tokenizer) -> float:
    """Exact match of the greedy answers (up to EOS) with the answer words."""
    engine = Engine(model)
    params = SamplingParams(max_new_tokens=8, temperature=0.0, stop_token_ids=frozenset({tokenizer.eos_id}))
    completions, _ = engine.generate([e[0] for e in held_out], params,
                                     fields={"pixel_values": torch.cat([e[1] for e in held_out])})
    model.train()
    # Token for token: the answer word, then EOS (an untrained model may name ids no text decodes to).
    right = [c.tokens == tokenizer.encode(" " + answer, bos=False, eos=False) + [tokenizer.eos_id]
             for c, (_, _, answer, *_) in zip(completions, held_out)]
    return sum(right) / len(right), completions


def test_greedy_answers_about_held_out_images_get_right(tmp_path, capsys):
    torch.manual_seed(0)
    spec = get_model_spec("llava")
    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    # Sized by the tokenizer as the trainer sizes it.
    args = spec.flavors["debugmodel"].update_from_config(vocab_size=tokenizer.vocab_size, seq_len=64)
    # The family's image inputs (ModelSpec.images) place the images in the prompts.
    processor = Processor(tokenizer, images=spec.images(args))
    model = materialize(spec.model_cls, args, seed=0)
    held_out = examples(processor, seed=1, n=96)
    before, _ = accuracy(model, held_out, tokenizer)

    train = examples(processor, seed=0, n=3200)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.0)
    started = time.perf_counter()
    steps, batch_size = 100, 32
    for step in range(steps):
        picked = [train[(step * batch_size + i) % len(train)] for i in range(batch_size)]
        tokens, labels, pixels = training_batch(picked, tokenizer)
        logits = model(tokens, pixel_values=pixels)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after, completions = accuracy(model, held_out, tokenizer)
    with capsys.disabled():
        print(f"exact match before {before:.2f}, after {after:.2f}; {steps} steps in "
              f"{time.perf_counter() - started:.1f} s")
    assert after >= 0.6 and after - before >= 0.4

    # scripts/generate.py --image on the Hugging Face export answers as the engine does.
    from titanlike.checkpoint.hf import write_hf
    from titanlike.cli.generate import main

    write_hf(model.state_dict(), spec, args, str(tmp_path / "hf"))
    ids, pixels, answer, image, question = held_out[0]
    image.save(tmp_path / "shapes.png")
    capsys.readouterr()
    assert main([str(tmp_path / "hf"), "--image", str(tmp_path / "shapes.png"), "--prompt", question,
                 "--temperature", "0", "--max-new-tokens", "8"]) == 0
    engine_text = tokenizer.decode([t for t in completions[0].tokens if t != tokenizer.eos_id])
    assert capsys.readouterr().out.strip() == question + engine_text
