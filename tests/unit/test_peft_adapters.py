"""PEFT adapters made by peft itself, read by titanlike: every field of adapter_config.json that changes
what the adapter computes is honoured (use_rslora, rank_pattern, alpha_pattern, all-linear targets) or
refused in one sentence; an adapter is data (safetensors only, every tensor floating point, finite and
of the job's shape; config values in range), checked before the first step."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from titanlike.models.lora import LoRAConverter, LoRAOptions, load_peft

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    from titanlike.models.llama3 import llama3_flavors
    from titanlike.models.registry import get_model_spec

    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=256, max_seq_len=64)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**get_model_spec("llama3").hf.args_to_config(args)))
    folder = tmp_path_factory.mktemp("peft") / "hf"
    hf.save_pretrained(folder)
    return folder


def _peft_adapter(hf_folder, folder, **config):
    """An adapter peft makes and saves (both matrices non-zero, as after training); the peft model."""
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_folder)
    model = peft.get_peft_model(base, peft.LoraConfig(task_type="CAUSAL_LM", **config))
    torch.manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.1)
    model.save_pretrained(folder)
    return model.eval()


def _ours(hf_folder, options: LoRAOptions):
    """The model as the trainer builds it: the base's load, the converter's swap and initialization, then
    its initial state (lora.adapter_path's A and B)."""
    import titanlike

    model = titanlike.load_model(hf_folder)
    converter = LoRAConverter(options)
    converter.convert(model)
    converter.init_weights(model, seed=0)
    model.load_state_dict(converter.initial_state(model), strict=False)
    return model.eval()


def _loss(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def test_rslora_rank_and_alpha_patterns_and_all_linear_give_peft_s_first_loss(hf_folder, tmp_path):
    adapter = tmp_path / "adapter"
    reference = _peft_adapter(hf_folder, adapter, r=4, lora_alpha=8, use_rslora=True, target_modules="all-linear",
                              rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
                              alpha_pattern={"v_proj": 3, r"model\.layers\.0\.mlp\.up_proj": 12})
    options = LoRAOptions(rank=4, alpha=8, use_rslora=True, target_modules=["all-linear"], adapter_path=str(adapter))
    options.check()
    ours = _ours(hf_folder, options)
    layer0, layer1 = ours.layers["0"], ours.layers["1"]
    assert layer0.attention.wq.lora_rank == 2 and layer1.feed_forward.w2.lora_rank == 6
    assert layer0.feed_forward.w2.lora_rank == 4 and layer0.attention.wv.lora_scaling == pytest.approx(3 / 2)
    assert layer0.feed_forward.w3.lora_scaling == pytest.approx(12 / 2)  # alpha / sqrt(r)
    assert not hasattr(ours.output, "lora_a")  # all-linear leaves the output head alone, as peft
    with torch.no_grad():
        want = reference(TOKENS, labels=TOKENS).loss
        got = _loss(ours(TOKENS), TOKENS)
        assert abs(float(got) - float(want)) < 1e-5, (float(got), float(want))
        # The adapters matter: without rslora (alpha / r) the loss is another.
        plain = _loss(_ours(hf_folder, dataclasses.replace(options, use_rslora=False, adapter_path=None))(TOKENS),
                      TOKENS)
        assert abs(float(plain) - float(want)) > 1e-3

    # The export names the patterned modules, and peft reads it back with the same loss.
    from titanlike.models.lora import export_peft
    from titanlike.models.registry import get_model_spec

    export_peft(ours.state_dict(), get_model_spec("llama3"), ours.model_args, str(tmp_path / "out"), options)
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["use_rslora"] is True and len(config["rank_pattern"]) == 3 and len(config["alpha_pattern"]) == 3
    with torch.no_grad():
        back = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(hf_folder),
                                              tmp_path / "out").eval()
        assert abs(float(back(TOKENS, labels=TOKENS).loss) - float(want)) < 1e-5


def test_an_adapter_with_more_modules_than_the_job_targets_is_refused_on_every_path(hf_folder, tmp_path):
    adapter = tmp_path / "adapter"
    _peft_adapter(hf_folder, adapter, r=4, lora_alpha=8, target_modules="all-linear")
    options = LoRAOptions(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                          adapter_path=str(adapter))
    import titanlike
    from titanlike.models.lora import apply_lora
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    with pytest.raises(ValueError, match="holds adapters of 6 modules this job does not adapt") as e:
        LoRAConverter.validate_model(options, _cfg(), spec, titanlike.load_model(hf_folder).model_args, model="m")
    assert "\n" not in str(e.value) and "lora.target_modules" in str(e.value)
    model = titanlike.load_model(hf_folder)
    apply_lora(model, dataclasses.replace(options, adapter_path=None))
    with pytest.raises(ValueError, match="holds adapters of 6 modules this job does not adapt"):
        load_peft(model, str(adapter))


def test_a_use_rslora_mismatch_and_refused_fields_are_one_sentence(hf_folder, tmp_path):
    adapter = tmp_path / "adapter"
    _peft_adapter(hf_folder, adapter, r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="was trained with use_rslora true .* but lora.use_rslora is false"):
        LoRAOptions(rank=4, alpha=8, target_modules=["q_proj"], adapter_path=str(adapter)).check()
    for field, value, words in [("bias", "all", "also trains the base model's biases"),
                                ("lora_bias", True, "its B matrices have biases"),
                                ("layer_replication", [[0, 1]], "duplicates layers"),
                                ("init_lora_weights", "pissa", "also changes the base model's weights"),
                                ("r", 0, "r is 0, but it must be an integer from 1 to 65536"),
                                ("r", 10**9, "must be an integer from 1 to 65536"),
                                ("lora_alpha", float("nan"), "lora_alpha is NaN, but it must be a finite number"),
                                ("rank_pattern", {"q_proj": -1}, "rank_pattern gives 'q_proj' the value -1"),
                                ("rank_pattern", {"(a+)+$": 2}, "repeats a group that repeats"),
                                ("alpha_pattern", {"x" * 300: 2}, "300 characters long, more than 256"),
                                ("alpha_pattern", {"q_proj(": 2}, "is not a regular expression"),
                                ("target_modules", 7, "target_modules is 7, not a name or a list of names")]:
        config = json.loads((adapter / "adapter_config.json").read_text())
        config[field] = value
        (adapter / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(ValueError) as e:
            LoRAOptions(rank=4, alpha=8, use_rslora=True, target_modules=["q_proj"], adapter_path=str(adapter)).check()
        assert words in str(e.value) and "\n" not in str(e.value), (field, str(e.value))
        config[field] = json.loads(json.dumps(peft.LoraConfig(r=4, lora_alpha=8).to_dict().get(field), default=str))
        if field == "target_modules":
            config[field] = ["q_proj"]
        if field in ("r", "lora_alpha"):
            config[field] = {"r": 4, "lora_alpha": 8}[field]
        (adapter / "adapter_config.json").write_text(json.dumps(config))


def _cfg():
    from titanlike.config import load_job_config

    return load_job_config([])


class _Marker:
    """Unpickling this writes a file: the proof a pickle was opened."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_an_adapter_is_data_a_pickle_is_never_opened_and_tensors_are_checked_by_name(hf_folder, tmp_path):
    import pickle

    import safetensors.torch

    import titanlike
    from titanlike.models.lora import apply_lora

    adapter = tmp_path / "adapter"
    _peft_adapter(hf_folder, adapter, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    options = LoRAOptions(rank=4, alpha=8, target_modules=["q_proj", "v_proj"], adapter_path=str(adapter))
    good = safetensors.torch.load_file(adapter / "adapter_model.safetensors")

    def model():
        m = titanlike.load_model(hf_folder)
        apply_lora(m, dataclasses.replace(options, adapter_path=None))
        return m

    # A pickle in place of safetensors: refused by name, never unpickled.
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((adapter / "adapter_config.json").read_text())
    marker = tmp_path / "unpickled"
    (pickled / "adapter_model.bin").write_bytes(pickle.dumps(_Marker(str(marker))))
    for load in (lambda: LoRAOptions(rank=4, alpha=8, adapter_path=str(pickled)).check(),
                 lambda: load_peft(model(), str(pickled))):
        with pytest.raises(ValueError, match="holds its weights as adapter_model.bin, a pickle, which titanlike never "
                                             "opens") as e:
            load()
        assert "\n" not in str(e.value)
    assert not marker.exists()

    name = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    for bad, words in [(good[name].to(torch.int32), f"{name} has dtype int32, but adapter weights are floating"),
                       (torch.full_like(good[name], float("nan")), f"{name} holds non-finite values"),
                       (good[name].double() * 1e300, f"{name} holds non-finite values (NaN or infinity, or beyond "
                        "float32's range)"),
                       (good[name][:, :2].contiguous(),
                        "has shapes (4, 64) and (32, 2), this model's (4, 64) and (32, 4)"),
                       (None, "holds base_model.model.stray, which is no tensor of this job's adapters")]:
        tensors = {**good, "base_model.model.stray": torch.zeros(2)} if bad is None else {**good, name: bad}
        safetensors.torch.save_file(tensors, adapter / "adapter_model.safetensors")
        for load in (lambda: LoRAConverter.validate_model(options, _cfg(), _spec(), model().model_args, model="m"),
                     lambda: load_peft(model(), str(adapter))):
            with pytest.raises(ValueError) as e:
                load()
            assert words in str(e.value) and "\n" not in str(e.value), str(e.value)


def _spec():
    from titanlike.models.registry import get_model_spec

    return get_model_spec("llama3")


def test_the_trainer_refuses_an_adapter_of_more_modules_before_any_process_group(tmp_path):
    """train.py's path: planning (the converter's validate_model) reads lora.adapter_path against the
    job's model, so an all-linear adapter given to a q,k,v,o job is a config error, not 8 of 14 loaded."""
    from titanlike.config import load_job_config
    from titanlike.config.loader import ConfigError
    from titanlike.models.lora import apply_lora, export_peft
    from titanlike.train.plan import plan_job

    base = ["--model.converters", "lora", "--lora.rank", "4", "--lora.alpha", "8", "--job.dump_folder",
            str(tmp_path / "o")]
    plan = plan_job(load_job_config(base), 1)
    with torch.device("meta"):
        model = plan.spec.model_cls(plan.model_args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    options = LoRAOptions(rank=4, alpha=8, target_modules=["all-linear"])
    apply_lora(model, options)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "lora_a"):
                m.lora_a.normal_(0, 0.1)
                m.lora_b.normal_(0, 0.1)
                m.lora_scale.fill_(m.lora_scaling)
    export_peft(model.state_dict(), plan.spec, plan.model_args, str(tmp_path / "all"), options)
    with pytest.raises(ConfigError) as e:
        plan_job(load_job_config([*base, "--lora.adapter_path", str(tmp_path / "all")]), 1)
    assert "modules this job does not adapt" in str(e.value) and "\n" not in str(e.value)
    plan_job(load_job_config([*base, "--lora.target_modules", "all-linear", "--lora.adapter_path",
                              str(tmp_path / "all")]), 1)
