"""titanlike-convert from-megatron on Megatron-LM's legacy torch format, against megatron-core itself: a tiny
megatron-core GPTModel per family runs in this process (tests/megatron_models.py: world size 1, gloo over an
in-memory store, nothing spawned), its weights are saved as Megatron-LM's save_checkpoint writes them
(model_optim_rng.pt per tensor- and pipeline-parallel rank), converted, and the converted model's logits are
megatron-core's. Hostile input fails with one sentence naming the file. The torch_dist format (whose writer
forks) and a train.py run from a converted checkpoint: tests/integration/test_megatron_torch_dist.py."""

from __future__ import annotations

import io
import json
import os
import pickle
import zipfile

import pytest
import torch

from megatron_models import FAMILIES, build_model, convert_options, megatron_world, reference_logits, save_torch
from titanlike.checkpoint.format import CheckpointError
from titanlike.checkpoint.hf import load_model
from titanlike.cli.convert import main as convert_main

VOCAB = 256


@pytest.fixture(scope="module")
def reference():
    """family -> (megatron-core model, tokens, its logits)."""
    out = {}
    with megatron_world():
        for family in FAMILIES:
            model = build_model(family, vocab_size=VOCAB, seed=1)
            tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
            out[family] = (model, tokens, reference_logits(model, tokens))
    return out


def convert(src, out, family, flavor=None, extra=()) -> int:
    """titanlike-convert from-megatron SRC OUT, as the user runs it (flavor: another than the test's)."""
    options = ["--model.name", family, "--model.flavor", flavor] if flavor else convert_options(family)
    return convert_main(["from-megatron", str(src), str(out), *options, *extra])


def assert_logits_match(ours: torch.Tensor, want: torch.Tensor) -> None:
    assert ours.shape == want.shape
    assert (ours - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("family,tp,pp,layout", [
    ("llama3", 1, 1, "local"), ("llama3", 2, 2, "local"), ("gpt2", 2, 1, "local"), ("gpt2", 1, 2, "local"),
    ("mixtral", 2, 1, "local"), ("qwen3", 2, 2, "te"), ("deepseek_v3", 2, 2, "te"), ("deepseek_v3", 2, 1, "grouped")])
def test_legacy_checkpoint_gives_megatron_core_logits(reference, tmp_path, family, tp, pp, layout):
    """layout: megatron-core's local layer spec, Transformer Engine's (te: its names, MLA's down projections
    whole on every rank), or the local spec with the legacy GroupedMLP's experts (--moe-grouped-gemm)."""
    model, tokens, want = reference[family]
    save_torch(model, str(tmp_path / "megatron"), family, tp=tp, pp=pp, te=layout == "te",
               grouped_mlp=layout == "grouped")
    assert convert(tmp_path / "megatron", tmp_path / "out", family) == 0
    with torch.no_grad():
        assert_logits_match(load_model(tmp_path / "out")(tokens), want)


def test_sizes_no_flavor_has(reference, tmp_path, capsys):
    """--model.args changes the flavor's sizes, by Megatron's names too, as train.py's does; the sidecar then
    records args and no flavor."""
    with megatron_world():
        model = build_model("llama3", vocab_size=VOCAB, seed=4, num_layers=2, num_query_groups=4)
        tokens = reference["llama3"][1]
        want = reference_logits(model, tokens)
    save_torch(model, str(tmp_path / "megatron"), "llama3", tp=2)
    argv = ["from-megatron", str(tmp_path / "megatron"), str(tmp_path / "out"), "--model.name", "llama3",
            "--model.flavor", "debugmodel_tiny"]
    assert convert_main([*argv, "--model.args", "num_layers=2,num_query_groups=4"]) == 0
    with torch.no_grad():
        assert_logits_match(load_model(tmp_path / "out")(tokens), want)
    assert "flavor" not in json.loads((tmp_path / "out" / "titanlike.json").read_text())["model"]
    assert convert_main([*argv, "--model.args", "num_layers=two"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.args.num_layers" in err, err


def test_rotary_interleaved(reference, tmp_path):
    """A model trained with --rotary-interleaved rotates adjacent pairs, as ours: its q/k rows stay in order."""
    with megatron_world():
        model = build_model("llama3", vocab_size=VOCAB, seed=5, rotary_interleaved=True)
        tokens = reference["llama3"][1]
        want = reference_logits(model, tokens)
    save_torch(model, str(tmp_path / "megatron"), "llama3", rotary_interleaved=True)
    assert convert(tmp_path / "megatron", tmp_path / "out", "llama3") == 0
    with torch.no_grad():
        assert_logits_match(load_model(tmp_path / "out")(tokens), want)


def test_gpt_trained_with_the_exact_gelu(reference, tmp_path, capsys):
    """Megatron-LM's default GELU is the exact one (GPT-2's is tanh's, --openai-gelu): the recorded args refuse
    the default flavor, naming the --model.args that fixes it, which then gives megatron-core's logits."""
    import torch.nn.functional as F

    with megatron_world():
        model = build_model("gpt2", vocab_size=VOCAB, seed=6, activation_func=F.gelu, openai_gelu=False)
        tokens = reference["gpt2"][1]
        want = reference_logits(model, tokens)
    save_torch(model, str(tmp_path / "megatron"), "gpt2", openai_gelu=False)
    err = _run(tmp_path / "megatron", tmp_path / "out", "gpt2", capsys)
    assert "exact GELU (no --openai-gelu)" in err and "(--model.args gelu_approximate=none)" in err, err
    assert convert(tmp_path / "megatron", tmp_path / "out", "gpt2", extra=["--model.args", "gelu_approximate=none"]) == 0
    with torch.no_grad():
        assert_logits_match(load_model(tmp_path / "out")(tokens), want)


def _run(src, out, family, capsys, flavor=None, extra=()) -> str:
    """The converter's refusal: exit 1, one line on stderr, nothing written."""
    assert convert(src, out, family, flavor, extra) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert not os.path.exists(out)
    return err


@pytest.fixture
def legacy(reference, tmp_path):
    save = tmp_path / "megatron"
    save_torch(reference["llama3"][0], str(save), "llama3", tp=2)
    return save


def test_missing_iteration_folder(legacy, tmp_path, capsys):
    (legacy / "latest_checkpointed_iteration.txt").write_text("20")
    err = _run(legacy, tmp_path / "out", "llama3", capsys)
    assert "latest_checkpointed_iteration.txt names iteration 20" in err and "iter_0000020 does not exist" in err
    err = _run(tmp_path / "nowhere", tmp_path / "out", "llama3", capsys)
    assert "nowhere does not exist" in err
    os.remove(legacy / "latest_checkpointed_iteration.txt")
    assert "has no latest_checkpointed_iteration.txt" in _run(legacy, tmp_path / "out", "llama3", capsys)


def test_missing_rank_file(legacy, tmp_path, capsys):
    os.remove(legacy / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt")
    err = _run(legacy, tmp_path / "out", "llama3", capsys)
    assert "mp_rank_01/model_optim_rng.pt is missing" in err
    os.rename(legacy / "iter_0000010" / "mp_rank_01", legacy / "iter_0000010" / "mp_rank_02")
    err = _run(legacy, tmp_path / "out", "llama3", capsys)
    assert "iter_0000010 lacks mp_rank_01/model_optim_rng.pt (it holds 3 tensor- and 1 pipeline-parallel" in err
    os.mkdir(legacy / "iter_0000010" / "mp_rank_00_000_001")
    err = _run(legacy, tmp_path / "out", "llama3", capsys)
    assert "mp_rank_00_000_001 is an expert-parallel rank's folder" in err


def test_virtual_pipeline_chunks_are_refused(legacy, tmp_path, capsys):
    path = legacy / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model0"], state["model1"] = state.pop("model"), {}
    torch.save(state, path)
    err = _run(legacy, tmp_path / "out", "llama3", capsys)
    assert f"{path} holds 2 virtual pipeline chunks (model0, model1)" in err


def test_truncated_and_tampered_files(legacy, tmp_path, capsys):
    path = legacy / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    err = _run(legacy, tmp_path / "out", "llama3", capsys)
    assert str(path) in err and "not a torch.save zip file" in err
    # The archive is whole but its pickle is garbage.
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(path, "w") as dst:
        for item in src.infolist():
            body = src.read(item)
            dst.writestr(item, b"\x80\x02garbage" if item.filename.endswith("data.pkl") else body)
    err = _run(legacy, tmp_path / "out", "llama3", capsys)
    assert str(path) in err and "damaged" in err
    # The directory says a tensor's record is longer than the file: refused before anything is mapped.
    central = data.rindex(b"PK\x01\x02")
    path.write_bytes(data[:central + 20] + (2**31).to_bytes(4, "little") * 2 + data[central + 28:])
    err = _run(legacy, tmp_path / "out", "llama3", capsys)
    assert f"{path} is truncated: its entry" in err


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


class _Foreign:
    pass


def test_disallowed_global_is_refused_before_unpickling(legacy, tmp_path, capsys):
    path = legacy / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    marker = tmp_path / "ran"
    state["args"].hook = _Evil(marker)
    torch.save(state, path)
    err = _run(legacy, tmp_path / "out", "llama3", capsys)
    assert str(path) in err and f"pickles {os.system.__module__}.system" in err and "refusing" in err
    assert not marker.exists()
    # Any class beside the placeholders' is refused alike, by name, harmless or not.
    state["args"].hook = {"x": _Foreign()}
    torch.save(state, path)
    assert f"pickles {_Foreign.__module__}._Foreign" in _run(legacy, tmp_path / "out", "llama3", capsys)


def test_shapes_of_another_flavor_or_family(legacy, tmp_path, capsys):
    err = _run(legacy, tmp_path / "out", "llama3", capsys, flavor="debugmodel")
    assert "iter_0000010 does not fit model llama3 flavor debugmodel" in err
    err = _run(legacy, tmp_path / "out", "gpt2", capsys, flavor="debugmodel")
    assert "does not fit model gpt2 flavor debugmodel" in err
    err = _run(legacy, tmp_path / "out", "llama3", capsys, flavor="nope")
    assert "model llama3 has no flavor 'nope'" in err
    err = _run(legacy, tmp_path / "out", "llama3", capsys, extra=["--true-vocab-size", str(VOCAB + 1)])
    assert f"--true-vocab-size {VOCAB + 1} is not between 1 and the {VOCAB} rows of" in err
    err = _run(legacy, tmp_path / "out", "bert", capsys, flavor="debugmodel")
    assert "model bert has no Megatron-LM mapping; families with one: " in err and "llama3" in err


def test_settings_no_shape_shows_must_agree(reference, tmp_path, capsys):
    """Megatron-LM's args record what the weights' shapes do not: RMSNorm epsilon, RoPE base and scaling.
    A flavor that differs is refused naming the --model.args that fixes it."""
    model = reference["llama3"][0]
    save_torch(model, str(tmp_path / "megatron"), "llama3", rotary_base=10000, norm_epsilon=1e-6)
    err = _run(tmp_path / "megatron", tmp_path / "out", "llama3", capsys)
    assert ("does not fit model llama3 flavor debugmodel_tiny: Megatron-LM trained it with norm_epsilon 1e-06, "
            "the flavor has norm_eps 1e-05 (--model.args norm_epsilon=1e-06)") in err
    err = _run(tmp_path / "megatron", tmp_path / "out", "llama3", capsys, extra=["--model.args", "norm_epsilon=1e-6"])
    assert "rotary_base 10000, the flavor has rope_theta 500000.0 (--model.args rotary_base=10000)" in err
    save_torch(model, str(tmp_path / "megatron"), "llama3", use_rope_scaling=False)
    err = _run(tmp_path / "megatron", tmp_path / "out", "llama3", capsys)
    assert "without --use-rope-scaling, the flavor scales RoPE (--model.args rope_scaling=none)" in err
    save_torch(model, str(tmp_path / "megatron"), "llama3", rope_scaling_factor=32.0)
    err = _run(tmp_path / "megatron", tmp_path / "out", "llama3", capsys)
    assert "--rope-scaling-factor 32.0, the flavor has 8.0 (--model.args rope_scaling.factor=32.0)" in err


def test_deepseek_with_yarn(reference, tmp_path):
    """DeepSeek-V3's YaRN (--rope-type yarn: frequencies, cos/sin magnitude and softmax scale with mscale and
    mscale_all_dim) gives megatron-core's logits; no debug flavor has YaRN, so the args come as [model.args]
    through the converter's API, which the checkpoint's recorded YaRN settings are checked against."""
    from titanlike.checkpoint.megatron import import_megatron_to_dcp

    yarn = dict(rotary_scaling_factor=4.0, original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0,
                mscale=1.0, mscale_all_dim=1.0)
    mla = {**FAMILIES["deepseek_v3"]["mla"], "rope_type": "yarn", **yarn}
    with megatron_world():
        model = build_model("deepseek_v3", vocab_size=VOCAB, seed=7, mla=mla)
        tokens = reference["deepseek_v3"][1]
        want = reference_logits(model, tokens)
    save_torch(model, str(tmp_path / "megatron"), "deepseek_v3", tp=2, **mla)
    overrides = dict(item.split("=") for item in FAMILIES["deepseek_v3"]["model_args"].split(","))
    scaling = dict(factor=4.0, original_max_position_embeddings=8, beta_fast=32.0, beta_slow=1.0, mscale=1.0,
                   mscale_all_dim=1.0)
    import_megatron_to_dcp(str(tmp_path / "megatron"), str(tmp_path / "out"), "deepseek_v3", "debugmodel",
                           overrides={**overrides, "rope_scaling": scaling})
    with torch.no_grad():
        assert_logits_match(load_model(tmp_path / "out")(tokens), want)
    with pytest.raises(CheckpointError, match=r"with beta_fast 32.0, the flavor has rope_scaling.beta_fast 16.0 "
                                              r"\(--model.args rope_scaling.beta_fast=32.0\)"):
        import_megatron_to_dcp(str(tmp_path / "megatron"), str(tmp_path / "again"), "deepseek_v3", "debugmodel",
                               overrides={**overrides, "rope_scaling": {**scaling, "beta_fast": 16.0}})


def test_deepseek_with_one_query_projection(reference, tmp_path):
    """MLA without the low-rank query (q_lora_rank None: linear_q_proj, column-parallel) into debugmodel_nolora."""
    with megatron_world():
        model = build_model("deepseek_v3", vocab_size=VOCAB, seed=8,
                            mla={**FAMILIES["deepseek_v3"]["mla"], "q_lora_rank": None})
        tokens = reference["deepseek_v3"][1]
        want = reference_logits(model, tokens)
    save_torch(model, str(tmp_path / "megatron"), "deepseek_v3", tp=2)
    assert convert(tmp_path / "megatron", tmp_path / "out", "deepseek_v3", "debugmodel_nolora",
                   extra=["--model.args", FAMILIES["deepseek_v3"]["model_args"]]) == 0
    with torch.no_grad():
        assert_logits_match(load_model(tmp_path / "out")(tokens), want)


def test_deepseek_settings_and_multi_token_prediction(reference, tmp_path, capsys):
    """DeepSeek-V3's router and RoPE settings that no shape shows are checked against the flavor; megatron-core's
    multi-token-prediction layers are refused by name, or left out for a flavor without them."""
    model = reference["deepseek_v3"][0]
    save = tmp_path / "megatron"
    save_torch(model, str(save), "deepseek_v3", moe_router_topk_scaling_factor=1.0)
    err = _run(save, tmp_path / "out", "deepseek_v3", capsys)
    assert ("--moe-router-topk-scaling-factor 1.0, the flavor has moe.route_scale 2.5 "
            "(--model.args moe.route_scale=1.0)") in err, err
    save_torch(model, str(save), "deepseek_v3", rope_type="yarn")
    assert "--rope-type yarn, the flavor has no rope_scaling" in _run(save, tmp_path / "out", "deepseek_v3", capsys)
    save_torch(model, str(save), "deepseek_v3", moe_router_num_groups=4, moe_router_group_topk=2)
    err = _run(save, tmp_path / "out", "deepseek_v3", capsys)
    assert "(--model.args moe.n_groups=4,moe.topk_groups=2)" in err, err
    grouped = FAMILIES["deepseek_v3"]["model_args"].replace("moe.n_groups=1,moe.topk_groups=1",
                                                             "moe.n_groups=4,moe.topk_groups=2")
    err = _run(save, tmp_path / "out", "deepseek_v3", capsys, flavor="debugmodel", extra=["--model.args", grouped])
    assert "ranks expert groups by their best top_k / group_topk = 1 scores, titanlike by their best 2" in err, err
    save_torch(model, str(save), "deepseek_v3")
    path = save / "iter_0000010" / "mp_rank_00" / "model_optim_rng.pt"
    state = torch.load(path, weights_only=False)
    state["model"]["mtp.layers.0.eh_proj.weight"] = torch.zeros(256, 512)
    torch.save(state, path)
    with_mtp = FAMILIES["deepseek_v3"]["model_args"].replace("mtp_num_layers=0,", "")
    err = _run(save, tmp_path / "out", "deepseek_v3", capsys, flavor="debugmodel", extra=["--model.args", with_mtp])
    assert ("holds multi-token-prediction layers (mtp.layers.0.eh_proj.weight, ...), which do not convert: "
            "megatron-core's read the trunk's output after its final norm") in err, err
    # Into a flavor without multi-token prediction they are left out: the trunk's logits.
    assert convert(save, tmp_path / "out", "deepseek_v3") == 0
    with torch.no_grad():
        assert_logits_match(load_model(tmp_path / "out")(reference["deepseek_v3"][1]), reference["deepseek_v3"][2])


def test_torch_dist_folder_with_missing_keys(reference, tmp_path, capsys):
    """A torch_dist folder (a DCP index of megatron-core's stacked keys) that lacks the final norm."""
    from titanlike.checkpoint.format import dcp_save

    model = reference["llama3"][0]
    stacked: dict[str, list[torch.Tensor]] = {}
    for key, value in model.state_dict().items():
        if key.endswith("_extra_state") or key == "decoder.final_layernorm.weight":
            continue
        if key.startswith("decoder.layers."):
            inner = key.split(".", 3)[3]
            stacked.setdefault(f"decoder.layers.{inner}", []).append(value)
        else:
            stacked[key] = [value]
    folder = tmp_path / "megatron" / "iter_0000010"
    dcp_save({k: torch.stack(v) if k.startswith("decoder.layers.") else v[0] for k, v in stacked.items()},
             str(folder), no_dist=True)
    (tmp_path / "megatron" / "latest_checkpointed_iteration.txt").write_text("10\n")
    err = _run(tmp_path / "megatron", tmp_path / "out", "llama3", capsys)
    assert str(folder) in err and "missing ['norm.weight']" in err
    # An index declaring a tensor far larger than the model is refused before anything is allocated.
    index = pickle.loads((folder / ".metadata").read_bytes())
    index.state_dict_metadata["decoder.layers.mlp.linear_fc2.weight"].size = torch.Size([8, 64, 10**9])
    (folder / ".metadata").write_bytes(pickle.dumps(index))
    err = _run(tmp_path / "megatron", tmp_path / "out", "llama3", capsys)
    assert "its index declares 512,000," in err and "refusing to allocate them" in err
    # An index that names a callable is refused by the allow-list unpickler, before anything runs.
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(_Evil(marker)))
    err = _run(tmp_path / "megatron", tmp_path / "out", "llama3", capsys)
    assert f"{folder}/.metadata refers to {os.system.__module__}.system" in err and not marker.exists()
