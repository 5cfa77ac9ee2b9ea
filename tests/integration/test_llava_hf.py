"""LLaVA Hugging Face interchange against transformers' own LlavaForConditionalGeneration (offline, random
init), with a CLIPVisionModel tower and a Llama language model, and with a SiglipVisionModel tower and a
Qwen3 one (the language model is any family of ours the registry finds), in fp32:
HF folder -> DCP (convert_hf_to_dcp's code) -> our model, and our checkpoints -> HF folder
(convert_dcp_to_hf's code) -> transformers, the same logits on the same images and prompts.

The tower has 3 layers read at vision_feature_layer -2 (LLaVA-1.5's choice): we build 2 and export
them read at -1, which transformers must compute the same from. Two samples, three images: the second
sample holds two, so the order of the features over the batch is checked too.
"""

from __future__ import annotations

import json
import sys
import tarfile

import pytest
import torch
from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, Qwen3Config,
                          SiglipVisionConfig)

import titanlike
from conftest import hf_warnings
from family_checks import materialize, write_model_only_dcp
from titanlike.checkpoint.hf import export_dcp_to_hf, import_hf_to_dcp
from titanlike.models.registry import get_model_spec
from titanlike.objectives.registry import family_objective

SPEC = get_model_spec("llava")
HF = SPEC.hf
ATOL = 1e-4
IMAGE_TOKEN = 299
# Tower -> (its config class, LLaVA's select strategy for it, the language model's config and our family).
TOWERS = {
    "clip": (CLIPVisionConfig, "default", LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300),
             "llama3"),
    "siglip": (SiglipVisionConfig, "full", Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                       vocab_size=300), "qwen3"),
}


def hf_model(tower: str, seed: int = 0) -> LlavaForConditionalGeneration:
    """A random LLaVA whose norms and biases are off their init, so a mis-mapped one shows in the logits."""
    vision_cls, select, text_config, _ = TOWERS[tower]
    torch.manual_seed(seed)
    config = LlavaConfig(
        vision_config=vision_cls(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 image_size=32, patch_size=8),
        text_config=text_config,
        image_token_index=IMAGE_TOKEN, vision_feature_layer=-2, vision_feature_select_strategy=select)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias") or "class_embedding" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def batch(tokens_per_image: int):
    """Prompts with 1 and 2 images' placeholders, and the 3 images in their order over the batch."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, IMAGE_TOKEN, (2, 30 + 2 * tokens_per_image), generator=g)
    tokens[0, 2:2 + tokens_per_image] = IMAGE_TOKEN
    tokens[1, 1:1 + tokens_per_image] = IMAGE_TOKEN
    tokens[1, 20:20 + tokens_per_image] = IMAGE_TOKEN
    return tokens, torch.randn(3, 3, 32, 32, generator=g)


@pytest.mark.parametrize("tower", sorted(TOWERS))
def test_both_ways_through_checkpoints(tmp_path, tower):
    hf = hf_model(tower)
    hf.save_pretrained(tmp_path / "hf")
    args = HF.read_config(json.loads((tmp_path / "hf" / "config.json").read_text()))
    assert args.vision.kind == tower and args.vision.n_layers == 2 and args.language_model == TOWERS[tower][3]
    tokens, images = batch(args.vision.tokens_per_image)
    with torch.no_grad():
        want = hf(input_ids=tokens, pixel_values=images).logits
        # The images matter: without them the placeholders are plain tokens.
        assert (hf(input_ids=tokens).logits - want).abs().max() > 1e-3

    # HF folder -> our model, directly and through a DCP checkpoint.
    import_hf_to_dcp(str(tmp_path / "hf"), str(tmp_path / "dcp"))
    assert json.loads((tmp_path / "dcp" / "titanlike.json").read_text())["model"]["name"] == "llava"
    for folder in ("hf", "dcp"):
        model = titanlike.load_model(tmp_path / folder)
        with torch.no_grad():
            torch.testing.assert_close(model(tokens, pixel_values=images), want, rtol=0, atol=ATOL)
    # Per-sample images (batch, images, C, H, W): sample 0's second image is padding nothing reads.
    per_sample = torch.stack([torch.cat([images[:1], torch.zeros_like(images[:1])]), images[1:]])
    with torch.no_grad():
        torch.testing.assert_close(model(tokens, pixel_values=per_sample), want, rtol=0, atol=ATOL)

    # Our DCP -> HF folder -> transformers: no tensor missing or unexpected, the same logits.
    export_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"] and config["vision_feature_layer"] == -1
    with hf_warnings() as warned:
        back, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info
    assert not [w for w in warned if "missing" in w.lower() or "unexpected" in w.lower()], warned
    with torch.no_grad():
        torch.testing.assert_close(back.eval()(input_ids=tokens, pixel_values=images).logits, want, rtol=0, atol=ATOL)

    # A tower whose width does not match the projector's input (a config.json edited apart from its
    # weights) is refused in one sentence naming the tensor.
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["vision_config"]["hidden_size"] = 48
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception, match=r"vision_tower\..* has shape .* but model llava needs") as e:
        titanlike.load_model(tmp_path / "hf")
    assert len(str(e.value).splitlines()) == 1

    # Our own init -> HF: a model trained here (its own weights) is what transformers computes.
    mine = materialize(SPEC.model_cls, args, seed=5).eval()
    write_model_only_dcp(mine, "llava", args, tmp_path / "mine")
    export_dcp_to_hf(str(tmp_path / "mine"), str(tmp_path / "mine_hf"))
    theirs = LlavaForConditionalGeneration.from_pretrained(tmp_path / "mine_hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=tokens, pixel_values=images).logits,
                                   mine(tokens, pixel_values=images), rtol=0, atol=ATOL)


def test_stage_1_starts_from_a_tower_and_a_language_model_of_separate_folders(tmp_path):
    """scripts/compose_llava.py: a CLIPVisionModel folder and a LlamaForCausalLM folder -> a LLaVA folder
    (transformers loads it whole) whose tower computes the CLIP model's layer -2 and whose language
    model the Llama's logits; train.py's stage 1 starts from it (sized by its config.json) and trains
    the new projector only: the saved tower and language model are the pretrained ones."""
    from conftest import REPO, train_metrics

    if str(REPO / "scripts") not in sys.path:  # imported as users run it (family_checks does the same)
        sys.path.insert(0, str(REPO / "scripts"))
    import compose_llava
    from transformers import CLIPVisionModel, LlamaForCausalLM

    torch.manual_seed(0)
    clip = CLIPVisionModel(CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                            num_attention_heads=4, image_size=32, patch_size=8)).eval()
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=2048)).eval()
    clip.save_pretrained(tmp_path / "clip")
    llama.save_pretrained(tmp_path / "llama")
    image_token = 1803  # <|image|> of the debug tokenizer the job trains with
    assert compose_llava.main(["--vision", str(tmp_path / "clip"), "--language", str(tmp_path / "llama"),
                               "--out", str(tmp_path / "llava"), "--image_token_id", str(image_token)]) == 0
    _, info = LlavaForConditionalGeneration.from_pretrained(tmp_path / "llava", output_loading_info=True)
    assert not any(info.values()), info
    composed = titanlike.load_model(tmp_path / "llava")
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, 1700, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(composed.vision_tower(images),
                                   clip(images, output_hidden_states=True).hidden_states[-2], rtol=0, atol=ATOL)
        torch.testing.assert_close(composed(tokens), llama(tokens).logits, rtol=0, atol=ATOL)

    train_metrics(tmp_path, "stage1", "--model.name", "llava", "--training.seq_len", "32", "--training.steps", "2",
                  "--llava.freeze", "vision_tower,language_model", "--checkpoint.enable", "--checkpoint.initial_load_path",
                  str(tmp_path / "llava"), "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_model_only")
    trained = titanlike.load_model(tmp_path / "stage1" / "checkpoint" / "step-2").state_dict()
    for name, value in composed.state_dict().items():
        same = torch.equal(trained[name], value)
        assert same != name.startswith("projector."), f"{name} {'did not train' if same else 'changed, but it is frozen'}"


def test_stage_2_with_lora_writes_an_adapter_peft_puts_on_transformers_llava(tmp_path):
    """LLaVA's stage 2 with LoRA as its recipe has it: adapters on the language model only (the tower's
    q_proj/v_proj left out by lora.exclude_modules), the projector trained in full (lora.modules_to_save),
    from a Hugging Face LLaVA folder. peft puts the exported adapter on transformers' model of that folder
    with the merged export's logits (its config names the projector to restore and the tower's linears to
    leave alone); a new run starting from the adapter (lora.adapter_path) holds the same weights."""
    peft = pytest.importorskip("peft")
    from conftest import train_metrics

    torch.manual_seed(0)
    image_token = 1803  # <|image|> of the debug tokenizer the job trains with
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, image_size=32, patch_size=8),
        text_config=LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=2048), image_token_index=image_token, vision_feature_layer=-1)
    LlavaForConditionalGeneration(config).save_pretrained(tmp_path / "base")
    job = ("--model.name", "llava", "--training.seq_len", "32", "--model.converters", "lora",
           "--lora.target_modules", "q_proj,v_proj,o_proj", "--lora.exclude_modules", "vision_tower",
           "--lora.modules_to_save", "multi_modal_projector", "--lr_scheduler.warmup_steps", "0",
           "--checkpoint.enable", "--checkpoint.initial_load_path", str(tmp_path / "base"),
           "--checkpoint.initial_load_in_hf", "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only")
    train_metrics(tmp_path, "stage2", *job, "--training.steps", "2", "--optimizer.lr", "1e-2")
    export = tmp_path / "stage2" / "checkpoint" / "step-2"
    adapter = json.loads((export / "adapter" / "adapter_config.json").read_text())
    assert adapter["modules_to_save"] == ["model.multi_modal_projector.linear_1", "model.multi_modal_projector.linear_2"]
    assert sorted(adapter["target_modules"]) == ["o_proj", "q_proj", "v_proj"]
    assert len(adapter["exclude_modules"]) == 4 and all(
        name.startswith("model.vision_tower.") for name in adapter["exclude_modules"])

    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 1700, (2, 24), generator=g)
    tokens[:, 2:18] = image_token
    images = torch.randn(2, 3, 32, 32, generator=g)
    with torch.no_grad(), hf_warnings():
        merged = LlavaForConditionalGeneration.from_pretrained(export).eval()
        base = LlavaForConditionalGeneration.from_pretrained(tmp_path / "base").eval()
        want = merged(input_ids=tokens, pixel_values=images).logits
        trained = merged.state_dict()
        for name, value in base.state_dict().items():
            same = torch.equal(trained[name], value)
            assert same == ("vision_tower" in name or "embed_tokens" in name or "norm" in name or "lm_head" in name
                            or "mlp" in name or "k_proj" in name), f"{name} {'did not train' if same else 'changed'}"
        before = base(input_ids=tokens, pixel_values=images).logits
        with_adapter = peft.PeftModel.from_pretrained(base, export / "adapter").eval()
        torch.testing.assert_close(with_adapter(input_ids=tokens, pixel_values=images).logits, want, rtol=0, atol=ATOL)
        assert (want - before).abs().max() > 1e-3

    train_metrics(tmp_path, "again", *job, "--training.steps", "1", "--optimizer.lr", "1e-12",
                  "--lora.adapter_path", str(export / "adapter"))
    with torch.no_grad(), hf_warnings():
        again = LlavaForConditionalGeneration.from_pretrained(tmp_path / "again" / "checkpoint" / "step-1").eval()
        torch.testing.assert_close(again(input_ids=tokens, pixel_values=images).logits, want, rtol=0, atol=ATOL)


def test_feature_layer_and_strategy_are_read_as_transformers_reads_them():
    config = HF.args_to_config(SPEC.flavors["debugmodel"])
    depth = config["vision_config"]["num_hidden_layers"]
    assert HF.config_to_args({**config, "vision_feature_layer": -2}).vision.n_layers == depth - 1
    assert HF.config_to_args({**config, "vision_feature_layer": 1}).vision.n_layers == 1
    full = HF.config_to_args({**config, "vision_feature_select_strategy": "full"}).vision
    assert full.tokens_per_image == full.num_patches + 1  # CLIP's class token kept
    for bad, words in (({"vision_feature_layer": [-2, -1]}, "several feature layers"),
                       ({"vision_feature_layer": -9}, "outside the tower"),
                       ({"vision_feature_select_strategy": "cls_patch"}, "select"),
                       ({"vision_config": {**config["vision_config"], "model_type": "dinov2"}}, "dinov2")):
        with pytest.raises(ValueError, match=words) as e:
            HF.read_config({**config, **bad})
        assert len(str(e.value).splitlines()) == 1


def test_a_transformers_4_config_reads_as_transformers_reads_it():
    """llava-hf/llava-1.5-7b-hf's config.json (written by transformers 4.36: sub-configs hold only their
    differences from their class's defaults) gives the llava-1.5-7b flavor, and what transformers 5
    makes of it reads the same."""
    sparse = {
        "architectures": ["LlavaForConditionalGeneration"], "ignore_index": -100, "image_token_index": 32000,
        "model_type": "llava", "pad_token_id": 32001, "projector_hidden_act": "gelu", "tie_word_embeddings": False,
        "text_config": {"_name_or_path": "lmsys/vicuna-7b-v1.5", "architectures": ["LlamaForCausalLM"],
                        "max_position_embeddings": 4096, "model_type": "llama", "rms_norm_eps": 1e-05,
                        "torch_dtype": "float16", "vocab_size": 32064},
        "torch_dtype": "float16", "transformers_version": "4.36.0.dev0",
        "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096,
                          "model_type": "clip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 24,
                          "patch_size": 14, "projection_dim": 768, "vocab_size": 32000},
        "vision_feature_layer": -2, "vision_feature_select_strategy": "default", "vocab_size": 32064,
    }
    assert HF.read_config(sparse) == SPEC.flavors["llava-1.5-7b"]
    full = LlavaConfig(**{k: v for k, v in sparse.items() if k != "model_type"}).to_dict()
    assert HF.read_config(full) == SPEC.flavors["llava-1.5-7b"]
    # No sub-configs at all: LlavaConfig's defaults (a CLIP ViT-L/14 at 336 px and LlamaConfig's).
    bare = HF.read_config({"model_type": "llava"})
    assert bare.vision == SPEC.flavors["llava-1.5-7b"].vision and bare.text.dim == 4096


def test_placeholders_and_images_must_agree():
    model = materialize(SPEC.model_cls, SPEC.flavors["debugmodel"])
    args = model.model_args
    p = args.vision.tokens_per_image
    image = torch.zeros(1, 3, 32, 32)
    # One placeholder more than the image gives; two images for one's placeholders; a partial image.
    for bad_tokens, images in ((p + 1, image), (p, torch.zeros(2, 3, 32, 32)), (p - 1, image[None])):
        tokens = torch.full((1, 40), 7)
        tokens[0, :bad_tokens] = args.image_token_id
        with pytest.raises(RuntimeError, match="placeholders do not match the images"):
            model(tokens, pixel_values=images)
    with pytest.raises(ValueError, match=r"images are \(3, 28, 28\)"):
        model(tokens, pixel_values=torch.zeros(1, 3, 28, 28))


def test_generate_chat_with_an_image_answers_as_transformers(tmp_path, capsys):
    """generate.py --chat --image: the image's placeholders open the user turn, a line before the question
    (LLaVA's chat format), so the prompt is the training sample of that conversation cut where the
    assistant's answer starts (data/image_text.py's conversation samples); the greedy answer is what
    transformers' LlavaForConditionalGeneration.generate gives on our HF export, fed that prompt and
    transformers' own CLIP processor's pixels."""
    from PIL import Image
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from titanlike.cli.generate import main
    from titanlike.checkpoint.hf import write_hf
    from titanlike.config.schema import JobConfig
    from titanlike.data import DEFAULT_TOKENIZER_PATH, build_tokenizer
    from titanlike.data.chat_template import load_chat_template
    from titanlike.data.image_text import IGNORE_INDEX, ImageTextSource
    from titanlike.inference.processor import Processor

    tokenizer = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    args = SPEC.flavors["debugmodel"].update_from_config(vocab_size=tokenizer.vocab_size, seq_len=96)
    model = materialize(SPEC.model_cls, args, seed=3).eval()
    write_hf(model.state_dict(), SPEC, args, str(tmp_path / "hf"))
    pixels = torch.randint(0, 256, (36, 40, 3), generator=torch.Generator().manual_seed(4), dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy())
    image.save(tmp_path / "noise.png")
    question = "What is in the picture?"
    assert main([str(tmp_path / "hf"), "--chat", "--image", str(tmp_path / "noise.png"), "--prompt", question,
                 "--temperature", "0", "--max-new-tokens", "6"]) == 0
    printed = capsys.readouterr().out

    # The training sample of the conversation, cut before the answer's first token.
    objective = family_objective(JobConfig(), SPEC, args)
    conversation = {"messages": [{"role": "user", "content": f"<image>\n{question}"},
                                 {"role": "assistant", "content": "Noise."}]}
    shard = str(tmp_path / "chat.tar")
    with tarfile.open(shard, "w") as tar:
        tar.add(tmp_path / "noise.png", "k.0.png")
        (tmp_path / "k.json").write_text(json.dumps(conversation))
        tar.add(tmp_path / "k.json", "k.json")
    sample = ImageTextSource(shard, tokenizer, seq_len=96, image_token_id=args.image_token_id,
                             tokens_per_image=objective.tokens_per_image, processor=objective.processor)[0]
    answer_at = int((sample["labels"] != IGNORE_INDEX).nonzero()[0][0])
    prompt = torch.from_numpy(sample["inputs"][:answer_at + 1])[None]
    assert (prompt == args.image_token_id).sum() == args.vision.tokens_per_image
    processor = Processor(tokenizer, template=load_chat_template("auto", tokenizer, option="--chat"),
                          images=SPEC.images(args))
    batch = processor([[{"role": "user", "content": question}]], [[image]])
    assert batch.ids == [prompt[0].tolist()] and batch.fields["pixel_values"].shape == (1, 1, 3, 32, 32)
    with pytest.raises(ValueError, match="spells the image token <\\|image\\|> itself"):
        processor.encode([{"role": "user", "content": "What is <|image|>?"}], [image])

    hf = LlavaForConditionalGeneration.from_pretrained(tmp_path / "hf").eval()
    clip = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processed = clip(image, return_tensors="pt")
    stops = [tokenizer.eot_id, tokenizer.eos_id]
    with torch.no_grad():
        out = hf.generate(input_ids=prompt, pixel_values=processed["pixel_values"],
                          max_new_tokens=6, do_sample=False, eos_token_id=stops, pad_token_id=tokenizer.eos_id)
    new = [t for t in out[0, prompt.shape[1]:].tolist() if t not in stops]
    assert new  # an answer to compare
    assert printed == f"{question}\n> {tokenizer.decode(new)}\n"
    # Marks and images must pair up, in one sentence.
    assert main([str(tmp_path / "hf"), "--chat", "--image", str(tmp_path / "noise.png"), "--prompt",
                 "<image> and <image>?", "--max-new-tokens", "1"]) == 1
    assert "2 <image> mark(s) but 1 image(s)" in capsys.readouterr().err
