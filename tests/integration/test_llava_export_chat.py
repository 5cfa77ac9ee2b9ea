"""A LLaVA export chats about an image (issue 45.6): `generate.py EXPORT --chat --image x.png` reads the
image token from the exported tokenizer.json (special there, as in the ranks file) and answers as from
the checkpoint with the ranks file; the export's preprocessor_config.json and processor_config.json
make transformers' AutoProcessor a LlavaProcessor whose pixels and expanded prompt equal ours."""

from __future__ import annotations

import pytest
import torch

from family_checks import materialize, write_model_only_dcp

transformers = pytest.importorskip("transformers")
Image = pytest.importorskip("PIL.Image")


def test_llava_export_chats_and_autoprocessor_loads_it(tmp_path, capsys):
    from titanlike.checkpoint.hf import export_dcp_to_hf
    from titanlike.cli.generate import main
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.inference.processor import Processor
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llava")
    ranks = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    args = spec.flavors["debugmodel"].update_from_config(vocab_size=ranks.vocab_size, seq_len=96)
    model = materialize(spec.model_cls, args, seed=3).eval()
    write_model_only_dcp(model, "llava", args, tmp_path / "dcp")
    export = tmp_path / "hf"
    assert export_dcp_to_hf(str(tmp_path / "dcp"), str(export), tokenizer_path=str(DEFAULT_TOKENIZER_PATH)).converted
    pixels = torch.randint(0, 256, (36, 40, 3), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy())
    image.save(tmp_path / "x.png")

    def chat(*extra: str) -> str:
        code = main([str(export), "--chat", "--image", str(tmp_path / "x.png"), "--prompt", "What is it?",
                     "--temperature", "0", "--max-new-tokens", "4", *extra])
        out = capsys.readouterr()
        assert code == 0, out.err
        return out.out

    assert chat() == chat("--tokenizer", str(DEFAULT_TOKENIZER_PATH))

    # transformers' processor of the export: the same pixels, the image token expanded as ours.
    from transformers import AutoProcessor

    theirs = AutoProcessor.from_pretrained(export)
    assert type(theirs).__name__ == "LlavaProcessor"
    tokenizer = build_tokenizer(str(export))
    ours = Processor(tokenizer, images=spec.images(args))
    batch = ours(["<image>What is it?"], [[image]])
    got = theirs(images=image, text=f"{theirs.image_token}What is it?", return_tensors="pt")
    torch.testing.assert_close(got["pixel_values"][0], batch.fields["pixel_values"][0, 0], rtol=0, atol=1e-6)
    assert got["input_ids"][0].tolist() == batch.ids[0]
