"""LoRA: adapters on a frozen model, written in the PEFT format that `peft` loads onto the
transformers model with our logits, merged into a full Hugging Face export, read back; bad targets
and adapters refused in one sentence."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from titanlike.models.lora import LoRALinear, LoRAOptions, adapters, apply_lora, export_peft, load_peft, merged_state_dict

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "feed_forward.w2"]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from titanlike.models.llama3 import llama3_flavors
    from titanlike.models.registry import get_model_spec

    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=256, max_seq_len=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**get_model_spec("llama3").hf.args_to_config(args)))
    folder = tmp_path_factory.mktemp("lora") / "hf"
    hf.save_pretrained(folder)
    return folder


def _lora_model(hf_folder, options: LoRAOptions, seed: int = 1):
    import titanlike

    model = titanlike.load_model(hf_folder)
    targets = apply_lora(model, options)
    torch.manual_seed(seed)
    with torch.no_grad():  # both matrices non-zero, as after training
        for module in adapters(model).values():
            module.lora_a.normal_(0, 0.1)
            module.lora_b.normal_(0, 0.1)
    return model, targets


def test_adapters_freeze_the_base_and_swap_only_the_targets(hf_folder):
    model, targets = _lora_model(hf_folder, LoRAOptions(rank=4, alpha=8, target_modules=TARGETS))
    assert targets == sorted(f"layers.{i}.{n}" for i in range(2) for n in
                             ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w2"))
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert trainable == sorted(f"{t}.{x}" for t in targets for x in ("lora_a", "lora_b"))
    # B = 0 at initialization: the adapted model is the base model.
    import titanlike

    base = titanlike.load_model(hf_folder)
    fresh = titanlike.load_model(hf_folder)
    apply_lora(fresh, LoRAOptions(rank=4, target_modules=TARGETS))
    for fqn, module in adapters(fresh).items():
        module.init_adapter(seed=0, fqn=fqn)
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(fresh(tokens), base(tokens), rtol=0, atol=0)
    assert all(isinstance(m, LoRALinear) for m in adapters(fresh).values())


@pytest.mark.parametrize("family,flavor", [("qwen3", "debugmodel_moe"), ("gpt_oss", "debugmodel"),
                                           ("qwen3_next", "debugmodel_tiny")])
def test_all_linear_leaves_routers_experts_and_sinks_alone(family, flavor):
    """A router reads its gate's weight in fp32 (an adapter there would never be computed) and transformers'
    routers are no nn.Linear (peft adapts none): all-linear adapts every other linear, Qwen3-Next's Gated
    DeltaNet projections and gated shared experts among them; a router named alone is refused."""
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec(family)
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors[flavor])
    targets = apply_lora(model, LoRAOptions(target_modules=["all-linear"]), spec=spec)
    assert targets and not [t for t in targets if ".router." in t]
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        f"{t}.{x}" for t in targets for x in ("lora_a", "lora_b")}  # experts, biases, sinks frozen
    if family == "qwen3_next":
        kinds = {t.split(".", 2)[-1] for t in targets}
        assert {"linear_attention.in_proj_qkvz", "linear_attention.in_proj_ba", "linear_attention.out_proj",
                "moe.shared_experts.gate"} <= kinds
    with torch.device("meta"):
        model = spec.model_cls(spec.flavors[flavor])
    with pytest.raises(ValueError, match="lora.target_modules router.gate matches no linear layer"):
        apply_lora(model, LoRAOptions(target_modules=["router.gate"]), spec=spec)


def test_a_projection_transformers_keeps_in_parts_exports_one_adapter_per_part(tmp_path):
    """Qwen3.5 keeps our in_proj_qkvz as in_proj_qkv and in_proj_z (in_proj_ba as in_proj_b and in_proj_a):
    the PEFT folder holds an adapter per part, each with our A and its rows of B, which read back as ours;
    parts with different A's (an adapter peft trained on them apart) are refused in one sentence."""
    from safetensors.torch import load_file, save_file

    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("qwen3_next")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], moe=None, n_layers=2, release="qwen3_5")
    options = LoRAOptions(rank=4, alpha=8, target_modules=["in_proj_qkvz", "in_proj_ba"])
    model = spec.model_cls(args)
    apply_lora(model, options, spec=spec)
    torch.manual_seed(0)
    with torch.no_grad():
        for module in adapters(model).values():
            module.lora_a.normal_(0, 0.1)
            module.lora_b.normal_(0, 0.1)
    written = export_peft(model.state_dict(), spec, args, str(tmp_path), options)
    assert written == ["in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z"]
    again = spec.model_cls(args)
    apply_lora(again, options, spec=spec)
    load_peft(again, str(tmp_path), spec=spec)
    for fqn, module in adapters(model).items():
        for name in ("lora_a", "lora_b"):
            assert torch.equal(getattr(adapters(again)[fqn], name), getattr(module, name)), (fqn, name)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    tensors["base_model.model.model.layers.0.linear_attn.in_proj_z.lora_A.weight"] += 1
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="holds different lora_A matrices for model.layers.0.linear_attn.in_proj_qkv "
                                         "and model.layers.0.linear_attn.in_proj_z, which this model computes as one "
                                         "projection"):
        load_peft(again, str(tmp_path), spec=spec)


def test_peft_loads_our_adapter_onto_the_transformers_model_with_our_logits(hf_folder, tmp_path):
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    options = LoRAOptions(rank=4, alpha=8, target_modules=TARGETS)
    model, _ = _lora_model(hf_folder, options)
    written = export_peft(model.state_dict(), spec, model.model_args, str(tmp_path / "adapter"), options)
    assert written == ["down_proj", "k_proj", "o_proj", "q_proj", "v_proj"]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"

    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        ours = model(tokens)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
        peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        torch.testing.assert_close(peft_model(tokens).logits, ours, rtol=0, atol=1e-4)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
        assert (base(tokens).logits - ours).abs().max() > 1e-2  # the adapters change the logits

        # Merged: W + (alpha / r) B A, through the family's HF conversion, in a plain transformers model.
        merged = spec.hf.to_hf_state_dict(merged_state_dict(model.state_dict()),
                                          model.model_args)
        base.load_state_dict(merged, strict=False)
        torch.testing.assert_close(base(tokens).logits, ours, rtol=0, atol=1e-4)

        # Import: the folder read back into fresh adapters gives the same model.
        again, _ = _lora_model(hf_folder, options, seed=2)
        load_peft(again, str(tmp_path / "adapter"))
        torch.testing.assert_close(again(tokens), ours, rtol=0, atol=1e-5)


def test_peft_loads_our_dora_adapter_with_our_logits(hf_folder, tmp_path):
    """lora.use_dora: the magnitudes start at the base's row norms (the adapted model is the base
    model while B is zero); trained (A, B and magnitudes perturbed), the PEFT export (use_dora,
    lora_magnitude_vector) gives our logits through peft on the transformers model, the merged
    export too, and the folder reads back into fresh adapters."""
    import titanlike
    from titanlike.models.lora import dora_magnitudes
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    options = LoRAOptions(rank=4, alpha=8, target_modules=TARGETS, use_dora=True)
    model = titanlike.load_model(hf_folder)
    apply_lora(model, options)
    for fqn, module in adapters(model).items():
        module.init_adapter(seed=0, fqn=fqn)
    model.load_state_dict(dora_magnitudes(model), strict=False)
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), titanlike.load_model(hf_folder)(tokens), rtol=0, atol=1e-5)
        torch.manual_seed(1)
        for module in adapters(model).values():
            module.lora_a.normal_(0, 0.1)
            module.lora_b.normal_(0, 0.1)
            module.lora_magnitude.mul_(1 + 0.2 * torch.rand_like(module.lora_magnitude))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert sum(n.endswith(".lora_magnitude") for n in trainable) == len(adapters(model)) and len(trainable) == 30
    written = export_peft(model.state_dict(), spec, model.model_args, str(tmp_path / "dora"), options)
    assert json.loads((tmp_path / "dora" / "adapter_config.json").read_text())["use_dora"] is True
    with torch.no_grad():
        ours = model(tokens)
        hf = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
        peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "dora").eval()
        torch.testing.assert_close(peft_model(tokens).logits, ours, rtol=0, atol=1e-4)
        plain = export_peft({k: v for k, v in model.state_dict().items() if not k.endswith(".lora_magnitude")},
                            spec, model.model_args, str(tmp_path / "plain"), LoRAOptions(rank=4, alpha=8))
        assert plain == written
        without = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval(),
                                                 tmp_path / "plain").eval()
        assert (without(tokens).logits - ours).abs().max() > 1e-3  # the magnitudes matter

        base = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
        base.load_state_dict(spec.hf.to_hf_state_dict(merged_state_dict(model.state_dict()), model.model_args),
                             strict=False)
        torch.testing.assert_close(base(tokens).logits, ours, rtol=0, atol=1e-4)

        again = titanlike.load_model(hf_folder)
        apply_lora(again, options)
        load_peft(again, str(tmp_path / "dora"))
        torch.testing.assert_close(again(tokens), ours, rtol=0, atol=1e-5)
        plain_model, _ = _lora_model(hf_folder, LoRAOptions(rank=4, alpha=8, target_modules=TARGETS))
        with pytest.raises(ValueError, match="is a DoRA adapter; this job's are plain LoRA"):
            load_peft(plain_model, str(tmp_path / "dora"))


def test_bad_targets_and_adapters_are_refused_in_one_sentence(hf_folder, tmp_path):
    import titanlike
    from titanlike.models.registry import get_model_spec

    with pytest.raises(ValueError, match="lora.target_modules qkv_proj matches no linear layer") as e:
        apply_lora(titanlike.load_model(hf_folder), LoRAOptions(target_modules=["q_proj", "qkv_proj"]))
    assert "\n" not in str(e.value)
    options = LoRAOptions(rank=4, alpha=8, target_modules=["q_proj"])
    model, _ = _lora_model(hf_folder, options)
    export_peft(model.state_dict(), get_model_spec("llama3"), model.model_args, str(tmp_path / "a"), options)
    other_rank, _ = _lora_model(hf_folder, LoRAOptions(rank=2, alpha=8, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match="of rank 4 and alpha 8; this job's adapters have rank 2"):
        load_peft(other_rank, str(tmp_path / "a"))
    more, _ = _lora_model(hf_folder, LoRAOptions(rank=4, alpha=8, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match="has no adapter for model.layers.0.self_attn.v_proj"):
        load_peft(more, str(tmp_path / "a"))
    with pytest.raises(ValueError, match="is not a PEFT adapter folder"):
        load_peft(model, str(tmp_path))
    # An adapter of another base model: the same module names, other sizes.
    spec = get_model_spec("llama3")
    other = spec.model_cls(dataclasses.replace(model.model_args, dim=128, n_heads=4, n_kv_heads=2))
    apply_lora(other, options)
    with torch.no_grad():
        for module in adapters(other).values():
            module.lora_a.normal_(0, 0.1)
            module.lora_b.normal_(0, 0.1)
            module.lora_scale.fill_(module.lora_scaling)
    export_peft(other.state_dict(), spec, other.model_args, str(tmp_path / "other"), options)
    with pytest.raises(ValueError, match=r"the adapter of model.layers.0.self_attn.q_proj has shapes \(4, 128\)") as e:
        load_peft(model, str(tmp_path / "other"))
    assert "another base model" in _one_line(e.value)


def _one_line(e: BaseException) -> str:
    assert "\n" not in str(e)
    return str(e)


def test_load_model_folds_a_lora_checkpoints_adapters_in(hf_folder, tmp_path):
    """A LoRA job's DCP (base weights, adapters and their scale) loads as the plain model with the
    adapters merged: the adapted model's logits."""
    import titanlike
    from family_checks import write_model_only_dcp

    model, _ = _lora_model(hf_folder, LoRAOptions(rank=4, alpha=8, target_modules=TARGETS))
    write_model_only_dcp(model, "llama3", model.model_args, tmp_path / "dcp")
    tokens = torch.randint(0, 256, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(titanlike.load_model(tmp_path / "dcp")(tokens), model(tokens), rtol=0, atol=1e-5)
    # convert_dcp_to_hf writes the merged model.
    from titanlike.checkpoint.hf import export_dcp_to_hf

    export_dcp_to_hf(str(tmp_path / "dcp"), str(tmp_path / "hf_out"))
    with torch.no_grad():
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_out").eval()
        torch.testing.assert_close(back(tokens).logits, model(tokens), rtol=0, atol=1e-4)


def test_an_adapter_of_another_rank_or_not_an_adapter_is_refused_before_training(hf_folder, tmp_path):
    from titanlike.config import load_job_config
    from titanlike.config.loader import ConfigError
    from titanlike.models.registry import get_model_spec
    from titanlike.train.plan import plan_job

    options = LoRAOptions(rank=4, alpha=8, target_modules=["q_proj"])
    model, _ = _lora_model(hf_folder, options)
    export_peft(model.state_dict(), get_model_spec("llama3"), model.model_args, str(tmp_path / "a"), options)
    for argv, words in [(["--lora.rank", "2", "--lora.adapter_path", str(tmp_path / "a")],
                         "holds adapters of rank 4 and alpha 8, but lora.rank is 2"),
                        (["--lora.adapter_path", str(tmp_path)], "is not a PEFT adapter folder"),
                        (["--lora.rank", "4", "--lora.alpha", "8", "--lora.use_dora", "--lora.adapter_path",
                          str(tmp_path / "a")], "holds plain LoRA adapters, but lora.use_dora is true")]:
        with pytest.raises(ConfigError) as e:
            plan_job(load_job_config(["--model.converters", "lora", *argv, "--job.dump_folder", str(tmp_path / "o")]), 1)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_dora_under_tensor_parallelism_is_refused_before_training(tmp_path):
    from titanlike.config import load_job_config
    from titanlike.config.loader import ConfigError
    from titanlike.train.plan import plan_job

    with pytest.raises(ConfigError) as e:
        plan_job(load_job_config(["--model.converters", "lora", "--lora.use_dora", "--parallelism.tensor_parallel_degree",
                                  "2", "--job.dump_folder", str(tmp_path)]), 2)
    assert str(e.value) == "lora.use_dora is not supported with tensor parallelism; use FSDP (or plain LoRA)"


def test_converters_disabled_computes_the_base_model_and_restores_the_adapters(hf_folder):
    """ModelConverters.disabled (DPO's reference with the adapters off): inside it the adapted model
    computes the base model's logits exactly; after it, its own again."""
    import titanlike
    from titanlike.models.converters import ModelConverters
    from titanlike.models.lora import LoRAConverter

    options = LoRAOptions(rank=4, alpha=8, target_modules=TARGETS)
    model, _ = _lora_model(hf_folder, options)
    base = titanlike.load_model(hf_folder)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        adapted = model(tokens)
        with ModelConverters([LoRAConverter(options)]).disabled([model]):
            off = model(tokens)
        again = model(tokens)
    assert torch.equal(off, base(tokens)) and not torch.allclose(adapted, off)
    assert torch.equal(again, adapted)


def test_load_model_merges_a_lora_checkpoint_through_the_registered_hook(hf_folder):
    """load_model knows no LoRA: the merge is the LoadHook models/lora.py registers."""
    from titanlike.models.load_hooks import merged, registered_hooks
    from titanlike.models.lora import LoRAMerge

    assert any(isinstance(h, LoRAMerge) for h in registered_hooks())
    model, _ = _lora_model(hf_folder, LoRAOptions(rank=4, alpha=8, target_modules=TARGETS))
    sd = dict(model.state_dict())
    assert merged(sd).keys() == merged_state_dict(sd).keys()
    assert all(torch.equal(v, merged_state_dict(sd)[k]) for k, v in merged(sd).items())


def test_the_adapter_names_its_base_folder_so_peft_loads_it_offline(hf_folder, tmp_path, monkeypatch):
    """adapter_config.json's base_model_name_or_path is the base folder, absolute (peft hands it to
    transformers, which resolves a relative path against the working directory): peft's
    AutoPeftModelForCausalLM loads the adapter from another directory with the Hub switched off."""
    import os

    import huggingface_hub

    from titanlike.models.registry import get_model_spec

    options = LoRAOptions(rank=4, alpha=8, target_modules=TARGETS)
    model, _ = _lora_model(hf_folder, options)
    adapter = tmp_path / "run" / "step-4" / "adapter"
    export_peft(model.state_dict(), get_model_spec("llama3"), model.model_args, str(adapter), options,
                base_model=os.path.relpath(hf_folder))
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(hf_folder.resolve())
    tokens = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # what HF_HUB_OFFLINE=1 sets
    monkeypatch.chdir(tmp_path / "run")
    with torch.no_grad():
        loaded = peft.AutoPeftModelForCausalLM.from_pretrained("step-4/adapter").eval()
        torch.testing.assert_close(loaded(tokens).logits, model(tokens), rtol=0, atol=1e-4)
