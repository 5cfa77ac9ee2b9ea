"""LoRA through train.py: from a Hugging Face folder, SFT with adapters, to a merged Hugging Face
export and a PEFT adapter that `peft` loads onto the base transformers model with the same logits;
and FSDP / TP runs with adapters equal to one process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import REPO, train_here, train_in_process, train_metrics
from sft_assets import TAGGED, tokenizer_folder

DATA = str(REPO / "tests" / "assets" / "sft" / "reverse_words.jsonl")


def test_lora_from_a_hugging_face_folder_to_a_peft_adapter(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import titanlike
    from titanlike.data import build_tokenizer
    from titanlike.models.llama3 import llama3_flavors
    from titanlike.models.registry import get_model_spec

    hf_folder = tokenizer_folder(tmp_path / "hf", TAGGED["chatml"])
    tokenizer = build_tokenizer(str(hf_folder))
    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], vocab_size=tokenizer.vocab_size, max_seq_len=2048)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**get_model_spec("llama3").hf.args_to_config(args))) \
        .save_pretrained(hf_folder)
    dump = tmp_path / "out"
    run = train_here(["--job.config_file", str(REPO / "train_configs" / "lora_debug.toml"), "--model.flavor",
                      "debugmodel_tiny", "--model.hf_assets_path", str(hf_folder), "--checkpoint.initial_load_in_hf",
                      "--checkpoint.last_save_in_hf", "--training.steps", "4", "--training.seq_len", "64",
                      "--training.local_batch_size", "4", "--metrics.no_enable_tensorboard",
                      "--job.dump_folder", str(dump)])
    assert run.returncode == 0, run.stderr[-3000:]
    assert "lora: rank 8, alpha 16 on 32 linear layers" in run.stderr
    export = dump / "checkpoint" / "step-4"
    # The adapter names the folder the job started from, so peft's AutoPeftModel finds its base offline.
    import json

    assert json.loads((export / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"] == \
        str(hf_folder.resolve())
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 16))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(export).eval()(tokens).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_folder).eval()
        before = base(tokens).logits
        with_adapter = peft.PeftModel.from_pretrained(base, export / "adapter").eval()(tokens).logits
        torch.testing.assert_close(with_adapter, merged, rtol=0, atol=1e-4)
        torch.testing.assert_close(titanlike.load_model(export)(tokens), merged, rtol=0, atol=1e-4)
        assert (merged - before).abs().max() > 1e-4  # the adapters trained

    # Import: a new run starts from the base folder and the adapter (a learning rate too small to move
    # anything), and exports the same merged model.
    again = tmp_path / "again"
    train_in_process(["--job.config_file", str(REPO / "train_configs" / "lora_debug.toml"), "--model.flavor",
                      "debugmodel_tiny", "--model.hf_assets_path", str(hf_folder), "--checkpoint.initial_load_in_hf",
                      "--checkpoint.last_save_in_hf", "--training.steps", "1", "--training.seq_len", "64",
                      "--training.local_batch_size", "4", "--optimizer.lr", "1e-12", "--metrics.no_enable_tensorboard",
                      "--lora.adapter_path", str(export / "adapter"), "--job.dump_folder", str(again)])
    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(again / "checkpoint" / "step-1").eval()
        torch.testing.assert_close(reloaded(tokens).logits, merged, rtol=0, atol=1e-4)


def test_a_peft_rslora_all_linear_adapter_through_train_py_starts_at_peft_s_loss(tmp_path):
    """train.py with lora.adapter_path of an adapter peft made (use_rslora, all-linear, a rank_pattern and an
    alpha_pattern) starts where peft's merged model starts: its first loss equals the loss of a run from
    peft's merge_and_unload folder (whose fresh adapters add nothing), on the same data."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from conftest import read_metrics
    from titanlike.data import build_tokenizer
    from titanlike.models.llama3 import llama3_flavors
    from titanlike.models.registry import get_model_spec

    hf_folder = tokenizer_folder(tmp_path / "hf", TAGGED["chatml"])
    merged_folder = tokenizer_folder(tmp_path / "merged", TAGGED["chatml"])
    tokenizer = build_tokenizer(str(hf_folder))
    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], vocab_size=tokenizer.vocab_size, max_seq_len=2048)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(**get_model_spec("llama3").hf.args_to_config(args)))
    base.save_pretrained(hf_folder)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, lora_alpha=16, use_rslora=True, target_modules="all-linear",
                                                      rank_pattern={"q_proj": 4}, alpha_pattern={"down_proj": 4}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 0.05)
    model.save_pretrained(tmp_path / "adapter")
    model.merge_and_unload().save_pretrained(merged_folder)
    job = ["--job.config_file", str(REPO / "train_configs" / "lora_debug.toml"), "--model.flavor", "debugmodel_tiny",
           "--checkpoint.initial_load_in_hf", "--training.steps", "1", "--training.seq_len", "64",
           "--training.local_batch_size", "4", "--metrics.no_enable_tensorboard", "--lora.use_rslora",
           "--lora.target_modules", "all-linear"]
    train_in_process([*job, "--model.hf_assets_path", str(hf_folder), "--lora.adapter_path", str(tmp_path / "adapter"),
                      "--job.dump_folder", str(tmp_path / "imported")])
    train_in_process([*job, "--model.hf_assets_path", str(merged_folder),
                      "--job.dump_folder", str(tmp_path / "merged_run")])
    imported, merged = (read_metrics(tmp_path / name)[0]["loss"] for name in ("imported", "merged_run"))
    assert imported == pytest.approx(merged, abs=1e-4), (imported, merged)
    base_run = tmp_path / "base_run"
    train_in_process([*job, "--model.hf_assets_path", str(hf_folder), "--job.dump_folder", str(base_run)])
    assert abs(read_metrics(base_run)[0]["loss"] - imported) > 1e-3  # the adapter changes the loss


SFT = ("--training.objective", "sft", "--training.dataset", "text", "--training.dataset_path", DATA,
       "--training.steps", "4", "--lr_scheduler.warmup_steps", "1", "--training.local_batch_size", "4",
       "--training.global_batch_size", "8")
LORA_SFT = (*SFT, "--model.converters", "lora", "--optimizer.lr", "1e-2")
LAYOUTS = {"fsdp": (), "tp": ("--parallelism.tensor_parallel_degree", "2"),
           "cp": ("--parallelism.context_parallel_degree", "2"),
           "pp": ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_microbatch_size", "2"),
           "ac": ("--activation_checkpoint.mode", "full"),
           "hsdp": ("--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2",
                    "--training.local_batch_size", "2")}


@pytest.mark.distributed
@pytest.mark.train_run(*LORA_SFT, name="one")
@pytest.mark.train_run(*LORA_SFT, *LAYOUTS["fsdp"], name="fsdp", nproc=2)
@pytest.mark.train_run(*LORA_SFT, *LAYOUTS["tp"], name="tp", nproc=2)
@pytest.mark.train_run(*LORA_SFT, *LAYOUTS["cp"], name="cp", nproc=2)
@pytest.mark.train_run(*LORA_SFT, *LAYOUTS["pp"], name="pp", nproc=2)
@pytest.mark.train_run(*LORA_SFT, *LAYOUTS["ac"], name="ac")
@pytest.mark.train_run(*LORA_SFT, *LAYOUTS["hsdp"], name="hsdp", nproc=4)
@pytest.mark.train_run(*LORA_SFT, "--lora.use_dora", name="dora")
@pytest.mark.train_run(*SFT, name="full_one")
@pytest.mark.train_run(*SFT, *LAYOUTS["hsdp"], name="full_hsdp", nproc=4)
def test_sft_with_lora_layouts_match_one_process(train_runs):
    """SFT (packed, document masks) with adapters: FSDP2, TP2, CP2, PP2, full activation checkpointing
    and HSDP 2x2 equal one process, step by step (loss and gradient norm), at a learning rate high
    enough that a wrong gradient shows. Full-parameter SFT under HSDP 2x2 too. DoRA through the
    trainer: its magnitudes start at the base's row norms (the first loss is LoRA's exactly), then
    train (another gradient norm, and it learns)."""
    dora = [(r["loss"], r["grad_norm"]) for r in train_runs["dora"].metrics]
    first = train_runs["one"].metrics[0]
    assert "dora: rank 8" in train_runs["dora"].output and dora[0][0] == first["loss"]
    assert dora[0][1] != pytest.approx(first["grad_norm"], rel=1e-3) and dora[-1][0] < dora[0][0]
    one = [(r["loss"], r["grad_norm"]) for r in train_runs["one"].metrics]
    # The adapters learn (at this learning rate the last step may overshoot: the lowest loss counts).
    assert len(one) == 4 and min(loss for loss, _ in one[1:]) < one[0][0] - 0.5
    full = [(r["loss"], r["grad_norm"]) for r in train_runs["full_one"].metrics]
    assert len(full) == 4 and full[-1][0] < full[0][0] and full[0][0] == first["loss"]  # adapters start at 0
    for name, want in [*((n, one) for n in LAYOUTS), ("full_hsdp", full)]:
        got = [(r["loss"], r["grad_norm"]) for r in train_runs[name].metrics]
        assert [loss for loss, _ in got] == pytest.approx([loss for loss, _ in want], abs=5e-5), name
        assert [norm for _, norm in got] == pytest.approx([norm for _, norm in want], rel=1e-4), name


def test_sft_with_lora_resumes_exactly_mid_epoch(tmp_path):
    """Stopped after step 2 of 4 (mid-epoch: 32 of ~250 samples) and resumed from its checkpoint, the
    run gives the uninterrupted run's steps 3 and 4 bit for bit: the adapters, their optimizer state
    and the position in the shuffled conversations are in the checkpoint. The run starts from a DCP
    checkpoint of the model without adapters (another seed's, as a pre-training run writes it): its
    adapters keep their initialization, so its first loss is full fine-tuning's from the same start."""
    import shutil

    train_metrics(tmp_path, "base", "--debug.seed", "7", "--checkpoint.enable", "--checkpoint.create_seed_checkpoint")
    sft = ["--training.objective", "sft", "--training.dataset", "text", "--training.dataset_path", DATA,
           "--training.steps", "4", "--training.local_batch_size", "4", "--checkpoint.enable",
           "--checkpoint.initial_load_path", str(tmp_path / "base" / "checkpoint" / "step-0")]
    full = train_metrics(tmp_path, "full", *sft, "--training.steps", "1")
    job = [*sft, "--model.converters", "lora", "--checkpoint.interval", "2", "--checkpoint.no_last_save_model_only"]
    whole = train_metrics(tmp_path, "whole", *job)
    assert whole[0]["loss"] == full[0]["loss"] and whole[0]["grad_norm"] != full[0]["grad_norm"]
    shutil.rmtree(tmp_path / "whole" / "checkpoint" / "step-4")
    (tmp_path / "whole" / "metrics.jsonl").unlink()
    resumed = train_metrics(tmp_path, "whole", *job)
    assert [r["step"] for r in resumed] == [3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in whole[2:]]


# The MoE family (qwen3 debugmodel_moe: 8 experts, top-2, a dense first layer) under SFT against one
# process: with adapters on the attention, the experts frozen (DTensors split over the ep ranks), and
# full-parameter SFT, the experts' gradients through the all-to-alls. Samples and document masks reach
# the routed tokens unchanged. 2-sample microbatches everywhere: the balancing losses are per microbatch.
MOE_SFT = ("--model.name", "qwen3", "--model.flavor", "debugmodel_moe", "--training.objective", "sft",
           "--training.dataset", "text", "--training.dataset_path", DATA, "--lr_scheduler.warmup_steps", "1",
           "--training.local_batch_size", "2", "--training.global_batch_size", "8", "--moe.seq_aux_loss_coeff", "0.001")
MOE_LORA_SFT = (*MOE_SFT, "--model.converters", "lora", "--optimizer.lr", "1e-2")
EP2 = ("--parallelism.expert_parallel_degree", "2")


@pytest.mark.distributed
@pytest.mark.train_run(*MOE_LORA_SFT, name="one")
@pytest.mark.train_run(*MOE_LORA_SFT, *EP2, name="ep2", nproc=2)
@pytest.mark.train_run(*MOE_SFT, name="full_one")
@pytest.mark.train_run(*MOE_SFT, *EP2, name="full_ep2", nproc=2)
def test_sft_on_an_moe_model_under_expert_parallelism_matches_one_process(train_runs):
    assert "lora: rank 8, alpha 16" in train_runs["one"].output
    for one_name, ep_name in (("one", "ep2"), ("full_one", "full_ep2")):
        one = [(r["loss"], r["grad_norm"], r["moe/aux_loss"]) for r in train_runs[one_name].metrics]
        ep = [(r["loss"], r["grad_norm"], r["moe/aux_loss"]) for r in train_runs[ep_name].metrics]
        assert len(one) == len(ep) == 4 and one[-1][0] < one[0][0], one_name
        for i, what in enumerate(("loss", "grad_norm", "moe/aux_loss")):
            got, want = [x[i] for x in ep], [x[i] for x in one]
            assert got == pytest.approx(want, rel=1e-4, abs=1e-6), (ep_name, what, got, want)


BF16 = ("--training.mixed_precision_param", "bfloat16")
BF16_BASE = (*BF16, "--lora.base_dtype", "bfloat16")


@pytest.mark.distributed
@pytest.mark.train_run(*LORA_SFT, *BF16, name="fsdp", nproc=2)
@pytest.mark.train_run(*LORA_SFT, *BF16_BASE, "--checkpoint.enable", "--checkpoint.interval", "4",
                       "--checkpoint.no_last_save_model_only", name="fsdp_bf16_base", nproc=2)
def test_lora_base_held_in_bfloat16_with_float32_adapters(train_runs):
    """lora.base_dtype bfloat16 (under bf16 mixed precision): the checkpoint holds every frozen weight
    in bf16, the adapters and their AdamW state (the only state there is) in fp32, and the FSDP2 run
    equals the fp32-base run to 1e-5 (FSDP casts an fp32 base to bf16 for compute anyway). In one
    process, where autocast keeps the embeddings, norms and residual stream fp32 for an fp32 base,
    the two differ by 1.5e-3 in loss (near 8) over these 4 steps (measured, not run here)."""
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(train_runs["fsdp_bf16_base"].folder / "checkpoint" / "step-4")) \
        .read_metadata().state_dict_metadata
    dtypes = {k: v.properties.dtype for k, v in meta.items() if hasattr(v, "properties")}
    model = {k: d for k, d in dtypes.items() if k.startswith("model.") and not k.endswith(".lora_scale")}
    adapter = {k: d for k, d in model.items() if k.endswith((".lora_a", ".lora_b"))}
    state = {k: d for k, d in dtypes.items() if k.startswith("optimizer.state.") and not k.endswith(".step")}
    assert adapter and set(adapter.values()) == {torch.float32}
    assert len(model) > len(adapter) and {d for k, d in model.items() if k not in adapter} == {torch.bfloat16}
    assert len(state) == 2 * len(adapter) and set(state.values()) == {torch.float32}
    assert all(".lora_a." in k or ".lora_b." in k for k in state)

    fsdp, bf16_base = ([(r["loss"], r["grad_norm"]) for r in train_runs[n].metrics] for n in ("fsdp", "fsdp_bf16_base"))
    assert len(bf16_base) == 4 and min(loss for loss, _ in bf16_base[1:]) < bf16_base[0][0] - 0.5
    assert [x for x, _ in bf16_base] == pytest.approx([x for x, _ in fsdp], abs=1e-5)
    assert [g for _, g in bf16_base] == pytest.approx([g for _, g in fsdp], rel=1e-4)


# Issue 43's families, SFT with adapters from a random transformers model of the debug flavor's shape: the
# targets by Hugging Face names (Qwen3-Next's Gated DeltaNet projections beside its attention; MoE routers,
# experts and gpt-oss's sinks are no linear peft adapts, nor do we), the merged export and the PEFT adapter.
# id -> (family, flavor, changes to its args, targets, adapted linears): Gemma 3's 6 layers of 7; Qwen3-Next's
# 2 attention layers of 4 and 2 Gated DeltaNet layers of 3; Qwen3.5 the same, where transformers keeps the
# projections apart (in_proj_qkv and in_proj_z for our in_proj_qkvz; in_proj_b and in_proj_a); gpt-oss's 4
# attention layers of 4.
DELTA_NET = "q_proj,k_proj,v_proj,o_proj,in_proj_qkvz,in_proj_ba,out_proj"
FAMILY_CASES = {
    "gemma3": ("gemma3", "debugmodel", {}, "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", 42),
    "qwen3_next": ("qwen3_next", "debugmodel_tiny", {}, DELTA_NET, 14),
    "qwen3_5": ("qwen3_next", "debugmodel", {"n_layers": 4, "release": "qwen3_5"}, DELTA_NET, 14),
    "gpt_oss": ("gpt_oss", "debugmodel", {}, "all-linear", 16),
}


@pytest.mark.parametrize("case", sorted(FAMILY_CASES))
def test_lora_sft_of_a_new_family_exports_what_transformers_and_peft_load(tmp_path, case):
    """Four steps of LoRA SFT from a Hugging Face folder: the loss is finite and falls, the merged export
    gives titanlike's logits in transformers within 1e-5 (fp32), peft puts the adapter on the base model
    with the merged model's logits, and a run starting from the adapter (lora.adapter_path, a learning rate
    too small to move anything) exports the same merged model."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    import math

    import titanlike
    from conftest import read_metrics
    from titanlike.data import build_tokenizer
    from titanlike.models.registry import get_model_spec

    family, flavor, changes, targets, adapted = FAMILY_CASES[case]
    spec = get_model_spec(family)
    hf_folder = tokenizer_folder(tmp_path / "hf", TAGGED["chatml"])
    tokenizer = build_tokenizer(str(hf_folder))
    args = dataclasses.replace(spec.flavors[flavor], vocab_size=tokenizer.vocab_size, max_seq_len=2048, **changes)
    config = spec.hf.args_to_config(args)
    cls = getattr(transformers, config["architectures"][0])
    torch.manual_seed(0)
    cls(cls.config_class(**config)).save_pretrained(hf_folder)
    dump = tmp_path / "out"
    job = ["--job.config_file", str(REPO / "train_configs" / "lora_debug.toml"), "--model.name", family,
           "--model.flavor", flavor, "--model.hf_assets_path", str(hf_folder), "--checkpoint.initial_load_in_hf",
           "--checkpoint.last_save_in_hf", "--lr_scheduler.warmup_steps", "1", "--training.seq_len", "64",
           "--training.local_batch_size", "4", "--lora.target_modules", targets, "--metrics.log_freq", "1",
           "--metrics.enable_jsonl", "--metrics.no_enable_tensorboard"]
    run = train_here([*job, "--training.steps", "4", "--job.dump_folder", str(dump)])
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"lora: rank 8, alpha 16 on {adapted} linear layers" in run.stderr
    losses = [r["loss"] for r in read_metrics(dump)]
    assert len(losses) == 4 and all(map(math.isfinite, losses)) and min(losses[1:]) < losses[0], losses
    export = dump / "checkpoint" / "step-4"
    tokens = torch.randint(0, tokenizer.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(export, attn_implementation="eager").eval()
        want = merged(tokens).logits
        torch.testing.assert_close(titanlike.load_model(export)(tokens), want, rtol=0, atol=1e-5)
        base = transformers.AutoModelForCausalLM.from_pretrained(hf_folder, attn_implementation="eager").eval()
        before = base(tokens).logits
        with_adapter = peft.PeftModel.from_pretrained(base, export / "adapter").eval()(tokens).logits
        torch.testing.assert_close(with_adapter, want, rtol=0, atol=1e-4)
        assert (want - before).abs().max() > 1e-4  # the adapters trained
    again = tmp_path / "again"
    train_in_process([*job, "--training.steps", "1", "--optimizer.lr", "1e-12", "--lora.adapter_path",
                      str(export / "adapter"), "--job.dump_folder", str(again)])
    with torch.no_grad():
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(again / "checkpoint" / "step-1",
                                                                     attn_implementation="eager").eval()
        torch.testing.assert_close(reloaded(tokens).logits, want, rtol=0, atol=1e-5)
