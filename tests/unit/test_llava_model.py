"""What is the llava family's own (the conformance suite covers what every family does; the Hugging Face
numerics are tests/integration/test_llava_hf.py): the language model comes from another family through
the registry, image features land on the placeholders of their own sample, jobs it cannot train are
refused, and the caption samples put the loss on the caption only. LLaVA's stage 1 through train.py:
tests/integration/test_llava_hf.py (from a pretrained tower and language model)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from family_checks import materialize, plan_family
from titanlike.models.outputs import IGNORE_INDEX
from titanlike.models.registry import get_model_spec

SPEC = get_model_spec("llava")


def test_the_language_model_is_the_named_family_built_through_the_registry():
    args = SPEC.flavors["debugmodel"]
    model = materialize(SPEC.model_cls, args)
    assert type(model.language_model) is get_model_spec("llama3").model_cls
    assert model.layers is model.language_model.layers
    with pytest.raises(ValueError, match="language_model 'bert' cannot take image features") as e:
        dataclasses.replace(args, language_model="bert", text=get_model_spec("bert").flavors["debugmodel"])
    assert len(str(e.value).splitlines()) == 1


def test_model_args_size_the_tower_and_the_language_model():
    plan = plan_family("llava", "debugmodel", "--model.args.text.hidden_size", "96", "--model.args.text.num_layers", "3",
                       "--model.args.vision.dim", "32")
    args = plan.model_args
    assert (args.text.dim, args.text.n_layers, args.vision.dim) == (96, 3, 32)
    with pytest.raises(Exception, match=r"model.args.text.hiden_size is not a setting") as e:
        plan_family("llava", "debugmodel", "--model.args.text.hiden_size", "96")
    assert len(str(e.value).splitlines()) == 1


def test_each_sample_takes_its_own_images_in_order():
    """Swapping two images of one sample changes that sample only, and its two placeholder runs swap
    features: each run of tokens_per_image placeholders is one image, in order."""
    model = materialize(SPEC.model_cls, SPEC.flavors["debugmodel_siglip"]).eval()
    args, p = model.model_args, model.model_args.vision.tokens_per_image
    tokens = torch.randint(0, 1000, (2, 2 * p + 8), generator=torch.Generator().manual_seed(0))
    tokens[:, 1:1 + p] = tokens[:, 3 + p:3 + 2 * p] = args.image_token_id
    images = torch.randn(2, 2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        embedded = []
        model.language_model.register_forward_pre_hook(lambda m, a, kw: embedded.append(kw["embeddings"]),
                                                        with_kwargs=True)
        before = model(tokens, pixel_values=images)
        swapped = images.clone()
        swapped[0] = images[0, [1, 0]]
        after = model(tokens, pixel_values=swapped)
        features = model.image_features(images[0])
    torch.testing.assert_close(after[1], before[1], rtol=0, atol=0)  # sample 1 kept its order
    assert (after[0] - before[0]).abs().max() > 1e-4
    torch.testing.assert_close(embedded[0][0, 1:1 + p], features[0], rtol=0, atol=0)
    torch.testing.assert_close(embedded[0][0, 3 + p:3 + 2 * p], features[1], rtol=0, atol=0)
    torch.testing.assert_close(embedded[1][0, 1:1 + p], features[1], rtol=0, atol=0)


def test_caption_samples_put_the_loss_on_the_caption_only():
    plan = plan_family("llava", "debugmodel")
    objective, tokenizer = plan.objective, plan.tokenizer
    p = plan.model_args.vision.tokens_per_image
    source = objective.samples("default", dataset_path=None, tokenizer=tokenizer, seq_len=48, seed=0).source
    sample = source[3]
    inputs, labels = sample["inputs"], sample["labels"]
    assert inputs[0] == tokenizer.bos_id and (inputs[1:1 + p] == objective.image_token_id).all()
    targets = labels[labels != IGNORE_INDEX].tolist()
    assert targets[-1] == tokenizer.eos_id and objective.image_token_id not in targets
    caption = tokenizer.decode(targets[:-1])
    assert caption.startswith("a ") and caption.endswith(".") and any(s in caption for s in ("circle", "square", "triangle"))
    assert sample["pixel_values"].shape == (1, 3, 32, 32)
    # Held-out images are other images.
    held_out = objective.samples("default", dataset_path=None, tokenizer=tokenizer, seq_len=48, seed=0,
                                 split_name="valid").source[3]
    assert not (held_out["pixel_values"] == sample["pixel_values"]).all()


@pytest.mark.parametrize("options, words", [
    (("--llava.freeze", "vision_tower,projector,language_model"), "nothing would train"),
    (("--llava.freeze", "vison_tower"), "'vison_tower' is not a part of llava"),
    (("--training.seq_len", "12"), "cannot hold llava.max_images 1 x 16 image tokens"),
    (("--llava.max_images", "2", "--training.dataset", "webdataset", "--training.dataset_path", "shards.tar"),
     "seq_len 32 cannot hold llava.max_images 2 x 16 image tokens and a caption; set it to at least 35"),
    (("--training.dataset", "c4_test"), "holds no images"),
    # The tower's heads are split by tensor parallelism as the language model's are.
    (("--parallelism.tensor_parallel_degree", "2", "--model.args.vision.n_heads", "3"),
     "vision tower's n_heads 3 must be divisible by parallelism.tensor_parallel_degree 2"),
])
def test_jobs_it_cannot_train_are_refused_in_one_sentence(options, words):
    from titanlike.config import ConfigError

    world = 2 if "tensor_parallel_degree" in options[0] else 1
    with pytest.raises((ConfigError, ValueError), match=words) as e:
        plan_family("llava", "debugmodel", *options, world_size=world,
                    **({"seq_len": int(options[1])} if options[0] == "--training.seq_len" else {}))
    assert len(str(e.value).splitlines()) == 1


def test_the_cache_with_images_equals_the_full_forward():
    """Generation: the prefill splices each row's image into its prompt (right-padded rows of different
    lengths), the language model's cache decodes; the logits equal full forwards over the whole
    sequence with the same image (fp32, 1e-5)."""
    from titanlike.models import protocol

    model = materialize(SPEC.model_cls, SPEC.flavors["debugmodel"]).eval()
    args, p = model.model_args, model.model_args.vision.tokens_per_image
    g = torch.Generator().manual_seed(0)
    prompts = [[1] + [args.image_token_id] * p + torch.randint(3, 1000, (n,), generator=g).tolist() for n in (5, 2)]
    images = torch.randn(2, 1, 3, 32, 32, generator=g)
    new = torch.randint(3, 1000, (2, 3), generator=g)
    init_cache, prefill, decode_step = protocol.generation_hooks(model)
    padded = torch.zeros(2, max(map(len, prompts)), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        padded[row, :len(prompt)] = torch.tensor(prompt)
    cache = init_cache(2, padded.shape[1] + 3, device="cpu", dtype=torch.float32)
    cached = [prefill(padded, torch.tensor([len(q) for q in prompts]), cache, pixel_values=images)]
    cached += [decode_step(new[:, step], cache) for step in range(3)]
    cached = torch.stack(cached, dim=1)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            full = model(torch.tensor([prompt + new[row].tolist()]), pixel_values=images[row:row + 1])[0]
            torch.testing.assert_close(cached[row], full[len(prompt) - 1:], rtol=0, atol=1e-5)


def test_flops_per_token_count_the_images_per_sample():
    """The tower and projector by hand (debugmodel: CLIP 48 wide, 2 layers, 17 positions, projector
    48 -> 64 -> 64) on top of the language model's count, over a sample of seq_len tokens, once per
    image a sample carries (llava.max_images)."""
    args = SPEC.flavors["debugmodel"]
    d, f, positions = 48, 96, 17
    block = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
    tower_params = 3 * 64 * d + 3 * d + 2 * block  # patch conv, class token and pre-norm, blocks
    projector = 48 * 64 + 64 * 64 + 2 * 64
    image = positions * (6 * tower_params + 12 * 2 * d * positions) + 6 * projector * 16
    assert args.flops_per_token(128) == args.text.flops_per_token(128) + image // 128
    three = plan_family("llava", "debugmodel", "--llava.max_images", "3", "--training.dataset", "webdataset",
                        "--training.dataset_path", "shards.tar", seq_len=128).model_args
    assert three.flops_per_token(128) == three.text.flops_per_token(128) + 3 * image // 128


def test_the_pipeline_split_gives_the_towers_stage_fewer_layers_when_its_images_weigh():
    """The tower and projector run on the first stage: their forward FLOPs (llava.max_images images of
    577 positions through CLIP ViT-L) count there, so LLaVA-1.5-7B's 32 layers over 4 stages at seq_len
    4096 split evenly for 1 image (it weighs under one layer) and leave the first stage fewer for 7 (the
    most the sequence holds: 7 x 576 placeholders)."""
    from titanlike.config import load_job_config
    from titanlike.train.plan import plan_job

    def layers(images: int) -> tuple[int, ...]:
        cfg = load_job_config(["--model.name", "llava", "--model.flavor", "llava-1.5-7b", "--training.seq_len", "4096",
                               "--training.local_batch_size", "4", "--parallelism.pipeline_parallel_degree", "4",
                               "--parallelism.pipeline_parallel_schedule", "1F1B", "--training.dataset", "webdataset",
                               "--training.dataset_path", "shards.tar", "--llava.max_images", str(images)])
        return plan_job(cfg, 4, vocab_size=32064).pipeline.layers

    assert layers(1) == (8, 8, 8, 8)
    heavy = layers(7)
    assert sum(heavy) == 32 and heavy[0] < min(heavy[1:]), heavy
    costs = SPEC.flavors["llava-1.5-7b"].layer_costs(4096)
    assert costs[0] > costs[1] == costs[-1]  # the tower weighs on the first layer only


@pytest.mark.parametrize("preset, flavor, world, tp, trains", [
    ("llava_1.5_7b_pretrain", "llava-1.5-7b", 8, 1, {"projector"}),
    ("llava_1.5_7b_finetune", "llava-1.5-7b", 8, 1, {"projector", "language_model"}),
    ("llava_1.5_7b_lora", "llava-1.5-7b", 8, 1, {"projector", "adapters"}),
    ("llava_1.5_13b_finetune", "llava-1.5-13b", 16, 2, {"projector", "language_model"}),
])
def test_the_presets_plan_from_a_hugging_face_folder(tmp_path, preset, flavor, world, tp, trains):
    """Each LLaVA-1.5 preset plans (plan_job, nothing allocated) on the GPUs its comment names, from a
    folder holding llava-hf's config.json of its size, and trains what its stage trains: stage 1 the
    projector, stage 2 the language model and the projector, LoRA adapters on every linear of the language
    model (none in the tower) beside the projector in full."""
    import io
    import json
    import tarfile

    from titanlike.config import load_job_config
    from titanlike.models.lora import apply_lora
    from titanlike.train.plan import plan_job

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(SPEC.hf.args_to_config(SPEC.flavors[flavor])))
    (tmp_path / "shards").mkdir()
    (tmp_path / "stage1").mkdir()
    (tmp_path / "stage1" / ".metadata").touch()  # planning checks that stage 1's checkpoint is one; loading reads it
    with tarfile.open(tmp_path / "shards" / "0.tar", "w") as tar:
        info = tarfile.TarInfo("k.txt")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"a cat"))
    cfg = load_job_config(["--job.config_file", f"train_configs/{preset}.toml", "--model.hf_assets_path",
                           str(tmp_path / "hf"), "--training.dataset_path", str(tmp_path / "shards"),
                           *(["--checkpoint.initial_load_path", str(tmp_path / "stage1")]
                             if "pretrain" not in preset else [])])
    plan = plan_job(cfg, world, vocab_size=32064)
    args, want = plan.model_args, SPEC.flavors[flavor]
    assert (plan.dims.dp_shard, plan.dims.tp) == (world // tp, tp)
    assert (args.text.dim, args.text.n_layers, args.vision.n_layers) == (want.text.dim, want.text.n_layers, 23)
    with torch.device("meta"):
        model = SPEC.model_cls(args)
    if "lora" in cfg.model.converters:
        apply_lora(model, cfg.lora)
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    parts = {"adapters" if name.endswith((".lora_a", ".lora_b")) else name.split(".")[0] for name in trained}
    assert parts == trains
    if "adapters" in trains:  # rank 128 on q, k, v, o, gate, up, down of each of the 32 layers
        dim, hidden = args.text.dim, 11008  # Vicuna-7B's MLP width
        per_layer = 4 * 128 * 2 * dim + 3 * 128 * (dim + hidden)
        adapters = sum(p.numel() for name, p in model.named_parameters() if name.endswith((".lora_a", ".lora_b")))
        assert adapters == 32 * per_layer and not any("vision_tower" in name for name in trained)


def test_checkpointing_and_compile_wrap_the_tower_blocks_too():
    """Activation checkpointing (full, and selective op by op) and per-block compile reach the vision
    tower's blocks as they reach the language model's (the extra_layers hook): the tower's blocks are
    wrapped, and the loss and every gradient equal those of the model without them (checkpointing
    recomputes the same ops; compile within fp32 rounding). Compiled with the eager backend: dynamo
    captures each block whole (fullgraph) in 2 s, where inductor's C++ takes ~50 s cold for the two
    block kinds (measured: its loss equal, its gradients within 6e-8; test_compile_parity runs inductor)."""
    import torch.nn.functional as F
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    from titanlike.models.common.init import canonical_fqn
    from titanlike.parallel.parallel_dims import ParallelDims
    from titanlike.parallel.parallelize import ParallelizeOptions, parallelize_model

    args = SPEC.flavors["debugmodel"]
    p = args.vision.tokens_per_image
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, 1000, (2, p + 8), generator=g)
    tokens[:, 1:1 + p] = args.image_token_id
    images = torch.randn(2, 1, 3, 32, 32, generator=g)

    def step(**options):
        model = materialize(SPEC.model_cls, args)
        parallelize_model(model, None, ParallelDims.resolve(world_size=1), ParallelizeOptions(**options))
        logits = model(tokens, pixel_values=images)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        grads = {canonical_fqn(name): param.grad for name, param in model.named_parameters()}
        assert all(g is not None for g in grads.values()) and len(grads) > 0
        return model, loss.detach(), grads

    _, want_loss, want = step()
    for options, tolerance in [({"activation_checkpoint_mode": "full"}, 0),
                               ({"activation_checkpoint_mode": "selective", "selective_ac_option": "op"}, 0),
                               ({"compile_blocks": True, "compile_backend": "eager"}, None)]:
        model, loss, got = step(**options)
        for layers in (model.vision_tower.layers, model.layers):
            for block in layers.values():
                assert (isinstance(block, CheckpointWrapper) if "activation_checkpoint_mode" in options
                        else block._compiled_call_impl is not None), options
        tol = {} if tolerance is None else {"rtol": tolerance, "atol": tolerance}
        torch.testing.assert_close(loss, want_loss, **tol)
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m: f"{options} {name}: {m}")
