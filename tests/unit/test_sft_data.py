"""Supervised fine-tuning data: our chat-template rendering and assistant masks against transformers'
apply_chat_template, the conversation forms, packing, the loss against TRL's SFTTrainer on the same
batch, and bad input refused in one sentence."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from sft_assets import CONVERSATIONS, TAGGED, TEMPLATES, TOKENIZER_ASSET, tokenizer_folder, write_jsonl
from titanlike.data import DataError, DEFAULT_TOKENIZER_PATH, build_tokenizer
from titanlike.data.chat_template import LLAMA3_TEMPLATE, load_chat_template, tokenize_conversation
from titanlike.data.conversations import best_fit_decreasing, iter_rows, tokenize_conversations
from titanlike.objectives import SFT, SFTOptions
from titanlike.objectives.base import BatchContext

transformers = pytest.importorskip("transformers")


def _hf_reference(hf_tok, conversation, tagged: bool) -> tuple[list[int], list[int]]:
    """transformers' ids and assistant mask: return_assistant_tokens_mask for a template with
    generation tags, else the tokens between each assistant turn's prompt (rendered with the
    generation prompt) and the end of that turn, each rendered and tokenized by transformers."""
    out = hf_tok.apply_chat_template(conversation, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=tagged)
    ids = list(out["input_ids"])
    if tagged:
        return ids, list(out["assistant_masks"])
    mask = [0] * len(ids)
    for k, message in enumerate(conversation):
        if message["role"] != "assistant":
            continue
        prompt = hf_tok.apply_chat_template(conversation[:k], tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        upto = hf_tok.apply_chat_template(conversation[: k + 1], tokenize=True, return_dict=True)["input_ids"]
        assert ids[: len(upto)] == list(upto) and ids[: len(prompt)] == list(prompt)
        mask[len(prompt): len(upto)] = [1] * (len(upto) - len(prompt))
    return ids, mask


CASES = [(name, False) for name in TEMPLATES] + [(name, True) for name in TAGGED]


@pytest.mark.parametrize("name,tagged", CASES, ids=[f"{n}{'-tagged' if t else ''}" for n, t in CASES])
def test_rendering_and_masks_match_transformers(tmp_path, name, tagged):
    folder = tokenizer_folder(tmp_path / name, (TAGGED if tagged else TEMPLATES)[name])
    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    ours = build_tokenizer(str(folder))
    template = load_chat_template("tokenizer", ours)
    assert template.has_generation_tags == tagged
    for conversation in CONVERSATIONS:
        if tagged and name == "gemma" and conversation[0]["role"] == "system":
            continue  # the tagged Gemma fixture has no system handling
        want_ids, want_mask = _hf_reference(hf_tok, conversation, tagged)
        ids, mask = tokenize_conversation(template, ours, conversation)
        assert ids == want_ids
        assert [int(m) for m in mask] == want_mask
        assert sum(mask) > 0


def test_builtin_template_on_the_tiktoken_tokenizer_matches_transformers():
    """The debug tokenizer (tiktoken, no chat template: titanlike's llama3 template) gives the ids and
    mask transformers gives with the same template on the same tokenizer as tokenizer.json."""
    tiktoken_tok = build_tokenizer(DEFAULT_TOKENIZER_PATH)
    template = load_chat_template("auto", tiktoken_tok)
    assert template.source == LLAMA3_TEMPLATE and "titanlike's llama3" in template.origin
    hf_tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER_ASSET)
    hf_tok.chat_template = LLAMA3_TEMPLATE
    for conversation in CONVERSATIONS:
        want_ids, want_mask = _hf_reference(hf_tok, conversation, tagged=True)
        ids, mask = tokenize_conversation(template, tiktoken_tok, conversation)
        assert ids == want_ids and [int(m) for m in mask] == want_mask


def test_two_column_forms_are_the_conversations_they_stand_for(tmp_path):
    folder = tokenizer_folder(tmp_path / "tok", TEMPLATES["chatml"])
    tok = build_tokenizer(str(folder))
    template = load_chat_template("auto", tok)
    rows = [("a", {"prompt": "Hello there", "completion": "Hi! How can I help?"}),
            ("b", {"instruction": "Add the numbers.", "input": "2 3", "output": "5"}),
            ("c", {"instruction": "Say hi.", "input": "", "output": "hi"}),
            ("d", {"messages": CONVERSATIONS[0]})]
    got = tokenize_conversations(rows, template, tok, seq_len=256)
    want = tokenize_conversations([("a", {"messages": CONVERSATIONS[0]}),
                                   ("b", {"messages": [{"role": "user", "content": "Add the numbers.\n\n2 3"},
                                                       {"role": "assistant", "content": "5"}]}),
                                   ("c", {"messages": [{"role": "user", "content": "Say hi."},
                                                       {"role": "assistant", "content": "hi"}]}),
                                   ("d", {"messages": CONVERSATIONS[0]})], template, tok, seq_len=256)
    for field in ("inputs", "labels", "bounds"):
        np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    # assistant_only_loss off: every position is a target.
    every = tokenize_conversations(rows, template, tok, seq_len=256, assistant_only_loss=False)
    assert (every.labels != -100).all() and (got.labels == -100).any()


def test_jsonl_parquet_and_saved_datasets_give_the_same_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    import pyarrow.parquet as pq

    rows = [{"messages": c} for c in CONVERSATIONS]
    write_jsonl(tmp_path / "c.jsonl", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "c.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    for path in ("c.jsonl", "c.parquet", "saved"):
        got = [r["messages"] for _, r in iter_rows(str(tmp_path / path))]
        # Parquet and Arrow give every message every key of the column's struct.
        got = [[{k: v for k, v in m.items() if v is not None} for m in c] for c in got]
        assert got == CONVERSATIONS, path


def test_best_fit_decreasing_packs_tightly():
    lengths = np.array([5, 9, 3, 7, 1, 4, 6, 2, 8])
    bins = best_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(lengths[b].sum() <= 10 for b in bins)
    assert len(bins) == 5  # 45 positions in bins of 10: the optimum
    assert bins[0] == [1, 4]  # the longest first, then the one that fills its bin best


def _samples(tmp_path, packing: bool, seq_len: int = 128):
    folder = tokenizer_folder(tmp_path / f"tok{packing}", TAGGED["chatml"])
    tok = build_tokenizer(str(folder))
    data = write_jsonl(tmp_path / "conv.jsonl", [{"messages": c} for c in CONVERSATIONS * 3])
    objective = SFT(SFTOptions(packing=packing))
    samples = objective.samples("text", dataset_path=str(data), tokenizer=tok, seq_len=seq_len, seed=0)
    return objective, samples, tok, folder


def test_packed_samples_hold_each_conversation_as_its_own_document(tmp_path):
    objective, samples, tok, _ = _samples(tmp_path, packing=True)
    _, padded, _, _ = _samples(tmp_path / "p", packing=False)
    assert len(samples.source) < len(padded.source) == 9
    sample = samples.source[0]
    ids = sample["document_ids"]
    assert (np.diff(ids) >= 0).all() and ids[-1] > ids[0]
    mb = objective.prepare({k: torch.from_numpy(v)[None] for k, v in sample.items()},
                           BatchContext(torch.device("cpu"), mask_kernel="sdpa"))
    # Positions restart at every conversation; attention stays inside it.
    starts = np.flatnonzero(np.diff(ids)) + 1
    assert (mb.positions[0, starts] == 0).all() and mb.positions[0, 0] == 0
    assert not mb.mask.dense[0, 0, starts[0], starts[0] - 1]
    # The same trained targets, packed or padded.
    packed = sorted(int(x) for s in range(len(samples.source)) for x in samples.source[s]["labels"] if x != -100)
    unpacked = sorted(int(x) for s in range(len(padded.source)) for x in padded.source[s]["labels"] if x != -100)
    assert packed == unpacked


def _hf_model(folder, vocab_size: int):
    from titanlike.models.llama3 import llama3_flavors
    from titanlike.models.registry import get_model_spec

    args = dataclasses.replace(llama3_flavors["debugmodel_tiny"], n_layers=2, vocab_size=vocab_size, max_seq_len=128)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**get_model_spec("llama3").hf.args_to_config(args)))
    hf.save_pretrained(folder)
    return hf.eval()


def _our_loss(model, objective, samples) -> float:
    ctx = BatchContext(torch.device("cpu"), mask_kernel="sdpa")
    source = samples.source
    batch = {k: torch.from_numpy(np.stack([source[i][k] for i in range(len(source))])) for k in source.fields}
    mb = objective.prepare(batch, ctx)
    with torch.no_grad():
        loss = objective.loss(model(mb.inputs, **mb.forward_kwargs()), mb.targets, ctx).value
    return loss.item() / int(mb.units)


def test_packed_and_padded_losses_equal_trls_sftTrainer(tmp_path):
    """TRL's SFTTrainer (assistant_only_loss, padded batches) on the conversations, and our objective's
    loss over the same conversations, packed and padded, with the same weights."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    import titanlike

    objective, packed, tok, folder = _samples(tmp_path, packing=True)
    _, padded, _, _ = _samples(tmp_path / "p", packing=False)
    hf = _hf_model(tmp_path / "hf", tok.vocab_size)
    ours = titanlike.load_model(tmp_path / "hf")
    loss_packed, loss_padded = _our_loss(ours, objective, packed), _our_loss(ours, objective, padded)

    hf_tok = transformers.AutoTokenizer.from_pretrained(folder)
    config = trl.SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, packing=False,
                           max_length=128, report_to=[], use_cpu=True, dataset_num_proc=None)
    trainer = trl.SFTTrainer(model=hf, args=config, processing_class=hf_tok,
                             train_dataset=datasets.Dataset.from_list([{"messages": c} for c in CONVERSATIONS * 3]))
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    batch = trainer.data_collator(rows)
    with torch.no_grad():
        trl_loss = trainer.compute_loss(hf, batch).item()
    assert abs(loss_padded - trl_loss) < 1e-5
    assert abs(loss_packed - trl_loss) < 1e-5


def test_padding_to_the_longest_cuts_each_microbatch_and_keeps_its_loss(tmp_path):
    """sft.padding longest: a microbatch of unpacked conversations ends at its last trained target,
    rounded up to sft.pad_to_multiple_of, and its loss (sum and count) is the seq_len-padded one's."""
    import titanlike

    _, padded, tok, _ = _samples(tmp_path, packing=False)
    _hf_model(tmp_path / "hf", tok.vocab_size)
    model = titanlike.load_model(tmp_path / "hf")
    ctx = BatchContext(torch.device("cpu"), mask_kernel="sdpa")
    source = padded.source
    for rows in ([0, 1, 2], [0, 3], [2]):
        batch = {k: torch.from_numpy(np.stack([source[i][k] for i in rows])) for k in source.fields}
        last = max(int(np.flatnonzero(source[i]["labels"] != -100)[-1]) for i in rows) + 1
        results = []
        for options in (SFTOptions(packing=False), SFTOptions(packing=False, padding="longest", pad_to_multiple_of=8)):
            objective = SFT(options)
            mb = objective.prepare(batch, ctx)
            with torch.no_grad():
                results.append((objective.loss(model(mb.inputs, **mb.forward_kwargs()), mb.targets, ctx).value.item(),
                                int((mb.targets["labels"] != -100).sum()), mb.inputs.shape[1]))
        (full, count, length), (cut, cut_count, cut_length) = results
        assert length == 128 and cut_length == -(-last // 8) * 8 < 128, (last, cut_length)
        assert cut_count == count and abs(cut - full) < 1e-5 * abs(full), (cut, full)


@pytest.mark.parametrize("argv, world, fragment", [
    (["--parallelism.pipeline_parallel_degree", "2"], 2, "parallelism.pipeline_parallel_degree 2 cannot take"),
    (["--parallelism.context_parallel_degree", "2"], 2, "parallelism.context_parallel_degree 2 cannot take"),
    (["--parallelism.tensor_parallel_degree", "2", "--sft.pad_to_multiple_of", "3"], 2,
     "sft.pad_to_multiple_of 3 must be a multiple of parallelism.tensor_parallel_degree 2"),
    (["--sft.pad_to_multiple_of", "0"], 1, "sft.pad_to_multiple_of must be at least 1"),
])
def test_padding_to_the_longest_refuses_layouts_of_one_length(tmp_path, argv, world, fragment):
    from titanlike.config import load_job_config
    from titanlike.config.loader import ConfigError
    from titanlike.train.plan import plan_job

    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    job = ["--training.objective", "sft", "--training.dataset", "text", "--training.dataset_path", str(data),
           "--sft.no_packing", "--sft.padding", "longest", *argv, "--job.dump_folder", str(tmp_path / "out")]
    with pytest.raises(ConfigError) as err:
        plan_job(load_job_config(job), world_size=world)
    assert fragment in str(err.value) and "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------- bad input


def _one_sentence(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text and "Traceback" not in text
    return text


def test_bad_conversations_are_refused_in_one_sentence(tmp_path):
    mistral = load_chat_template("tokenizer", build_tokenizer(str(tokenizer_folder(tmp_path / "m", TEMPLATES["mistral"]))))
    llama3 = load_chat_template("tokenizer", build_tokenizer(str(tokenizer_folder(tmp_path / "l", TEMPLATES["llama3"]))))
    tok = build_tokenizer(str(tokenizer_folder(tmp_path / "c", TEMPLATES["chatml"])))
    chatml = load_chat_template("auto", tok)
    cases = [
        (llama3, {"messages": [{"role": "user", "content": "hi"}, {"role": "narrator", "content": "x"},
                               {"role": "assistant", "content": "ok"}]}, "refused the conversation: Unknown role narrator"),
        (chatml, {"messages": [{"role": "user", "content": "hi"}]}, "has no assistant turn"),
        (mistral, {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]},
         "refused the conversation: Conversation roles must alternate"),
        # (a {"text": ...} row is TRL's language-modeling form, read since issue 45: tests/unit/test_trl_rows.py)
        (chatml, {"body": "plain"}, "none of the conversation forms"),
        (chatml, {"messages": "hi"}, "'messages' is not a list"),
        (chatml, {"prompt": 3, "completion": "x"}, "'prompt' is int"),
    ]
    for template, row, words in cases:
        with pytest.raises(DataError) as e:
            tokenize_conversations([("conv.jsonl line 1", row)], template, tok, seq_len=64)
        assert words in _one_sentence(e.value) and "conv.jsonl line 1" in str(e.value)


def test_bad_templates_are_refused_in_one_sentence(tmp_path):
    plain = build_tokenizer(str(tokenizer_folder(tmp_path / "none")))
    with pytest.raises(DataError, match="has no chat_template"):
        load_chat_template("tokenizer", plain)
    assert "llama3" in load_chat_template("auto", plain).origin  # the fallback
    with pytest.raises(DataError, match="does not compile"):
        load_chat_template("tokenizer", build_tokenizer(str(tokenizer_folder(tmp_path / "broken", "{% for %}"))))
    with pytest.raises(DataError, match="neither auto"):
        load_chat_template("no_such_template", plain)
    raising = tokenizer_folder(tmp_path / "raises", "{{ messages[0]['content'] / 2 }}")
    tok = build_tokenizer(str(raising))
    with pytest.raises(DataError, match="refused the conversation"):
        tokenize_conversations([("x", {"messages": CONVERSATIONS[0]})], load_chat_template("tokenizer", tok), tok,
                               seq_len=64)
    # A template that rewrites earlier turns once later ones follow (as Qwen3's drops old reasoning).
    rewriting = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] if loop.last or m['role'] != 'assistant' "
                 "else '...' }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    tok = build_tokenizer(str(tokenizer_folder(tmp_path / "rewrites", rewriting)))
    with pytest.raises(DataError, match="generation"):
        tokenize_conversations([("x", {"messages": CONVERSATIONS[1]})], load_chat_template("tokenizer", tok), tok,
                               seq_len=128)


def test_overlong_conversations_are_truncated_or_dropped_and_counted(tmp_path, caplog):
    tok = build_tokenizer(str(tokenizer_folder(tmp_path / "c", TAGGED["chatml"])))
    template = load_chat_template("auto", tok)
    rows = [("a", {"messages": CONVERSATIONS[0]}), ("b", {"messages": CONVERSATIONS[1]})]
    with caplog.at_level("INFO", logger="titanlike"):
        kept = tokenize_conversations(rows, template, tok, seq_len=50)
        assert "1 conversations longer than seq_len + 1 = 51 tokens truncated, 0 dropped" in caplog.text
        assert kept.lengths().tolist()[1] == 50
        dropped = tokenize_conversations(rows, template, tok, seq_len=50, overlong="drop")
        assert len(dropped) == 1 and "0 truncated" not in caplog.text
    with pytest.raises(DataError, match="no conversation is left"):
        tokenize_conversations(rows[1:], template, tok, seq_len=50, overlong="drop")


# ---------------------------------------------------------------------------------------------- the job's rules


@pytest.mark.parametrize("argv, fragment", [
    (["--training.objective", "ppo"],
     "training.objective 'ppo' is unknown for llama3 debugmodel; known: causal_lm, distill, dpo, grpo, reward, sft"),
    (["--training.objective", "sft"], "training.dataset 'default' cannot give sft samples"),
    (["--training.objective", "sft", "--training.dataset", "text"], "training.dataset text needs training.dataset_path"),
    (["--training.objective", "sft", "--training.dataset", "text", "--training.dataset_path", "/nope"],
     "training.dataset_path: dataset_path /nope does not exist"),
    (["--training.objective", "sft", "--training.dataset", "text", "--training.dataset_path", "{data}",
      "--training.document_masking"], "sft samples carry their own document masks"),
    (["--training.objective", "sft", "--model.name", "bert", "--training.seq_len", "128"], "sft fine-tunes models that predict the next token; "
     "bert debugmodel trains with masked_lm"),
    (["--training.objective", "sft", "--training.dataset", "text", "--training.dataset_path", "{data}",
      "--model.converters", "lora", "--lora.target_modules", "q_proj,qkv"],
     "lora.target_modules qkv matches no linear layer of llama3 debugmodel"),
    (["--model.converters", "lora", "--lora.modules_to_save", "multi_modal_projector"],
     "lora.modules_to_save multi_modal_projector names no module of llama3 debugmodel"),
    (["--model.converters", "lora", "--lora.exclude_modules", "attention"],
     "lora.target_modules q_proj, k_proj, v_proj, o_proj matches no linear layer of llama3 debugmodel"),
    (["--model.converters", "lora", "--lora.rank", "0"], "lora.rank must be at least 1"),
    (["--model.converters", "lora", "--lora.use_dora", "--parallelism.tensor_parallel_degree", "1",
      "--lora.dropout", "0.1"], "lora.use_dora with lora.dropout is not supported"),
    (["--model.converters", "lora", "--lora.base_dtype", "bfloat16", "--training.mixed_precision_param", "float32"],
     "lora.base_dtype bfloat16 needs training.mixed_precision_param bfloat16 (it is float32)"),
    (["--sft.no_packing"], "sft.packing is set, but it configures training.objective sft and this job's objective "
     "is causal_lm"),
    (["--lora.rank", "4"], "lora.rank is set, but model.converters does not name lora"),
])
def test_job_rules_refuse_in_one_sentence(tmp_path, argv, fragment):
    from titanlike.config import load_job_config
    from titanlike.config.loader import ConfigError
    from titanlike.train.plan import plan_job

    data = write_jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in CONVERSATIONS])
    argv = [a.replace("{data}", str(data)) for a in argv]
    with pytest.raises(ConfigError) as err:
        plan_job(load_job_config([*argv, "--job.dump_folder", str(tmp_path / "out")]), world_size=1)
    assert fragment in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("preset, flavor, world, adapters", [
    ("sft_llama3_8b", "8B", 8, 0),
    ("lora_llama3_8b", "8B", 1, 41_943_040),  # rank 16 on the 7 linears of 32 blocks
    ("lora_llama3_8b", "8B", 8, 41_943_040),
    ("sft_llama3_70b", "70B", 64, 0),
    ("lora_llama3_70b", "70B", 8, 207_093_760),  # of 80 blocks
])
def test_fine_tuning_presets_plan_from_a_hugging_face_folder(tmp_path, monkeypatch, preset, flavor, world, adapters):
    """Each size's preset plans (plan_job, no weights built) from a Hugging Face folder holding that
    model's config.json, on the GPUs its comment names; LoRA's targets name the linears they claim.
    Planning allocates nothing, so this host's memory does not limit it (loading checks the device)."""
    import json

    from titanlike.config import load_job_config
    from titanlike.models.llama3 import llama3_flavors
    from titanlike.models.lora import apply_lora
    from titanlike.models.registry import get_model_spec
    from titanlike.train.plan import plan_job

    spec = get_model_spec("llama3")
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(spec.hf.args_to_config(llama3_flavors[flavor])))
    cfg = load_job_config(["--job.config_file", f"train_configs/{preset}.toml", "--model.hf_assets_path", str(folder)])
    plan = plan_job(cfg, world, vocab_size=128256)
    assert plan.objective.name == "sft" and plan.dims.dp_shard == world and plan.precision.param_dtype == "bfloat16"
    assert plan.model_args.dim == llama3_flavors[flavor].dim and plan.model_args.n_layers == llama3_flavors[flavor].n_layers
    assert ("lora" in cfg.model.converters) == bool(adapters)
    if adapters:
        with torch.device("meta"):
            model = spec.model_cls(plan.model_args)
        apply_lora(model, cfg.lora)
        assert sum(p.numel() for p in model.parameters() if p.requires_grad) == adapters
        assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_end_of_turn_tokens_where_sampling_stops(tmp_path):
    from titanlike.data.chat_template import end_of_turn_ids

    want = {"llama3": "<|eot_id|>", "chatml": "<|im_end|>", "gemma": "<end_of_turn>", "mistral": "<|end_of_text|>"}
    for name, token in want.items():
        tok = build_tokenizer(str(tokenizer_folder(tmp_path / name, TEMPLATES[name])))
        stops = end_of_turn_ids(load_chat_template("tokenizer", tok), tok)
        assert stops == {tok.eos_id, tok.model.token_to_id(token)}, name


@pytest.mark.parametrize("name", ["deepseek_r1_distill", "deepseek_r1_distill_training"])
def test_end_of_turn_of_deepseek_r1(tmp_path, name):
    """DeepSeek-R1's generation prompt opens a reasoning block (`<｜Assistant｜><think>\n`) that the
    rendered answer does not hold, and its published template rewrites earlier turns: the end of the
    turn is still found (its `<｜end▁of▁sentence｜>`, here a special token of its own beside the
    debug tokenizer's EOS), where rendering the prompt first found nothing or refused the template."""
    from pathlib import Path

    from tokenizers import AddedToken, Tokenizer

    import titanlike.data
    from titanlike.data.chat_template import end_of_turn_ids

    assets = Path(titanlike.data.__file__).parent / "assets" / "chat_templates"
    source = (assets / f"{name}.jinja").read_text(encoding="utf-8")
    folder = tokenizer_folder(tmp_path / name, source)
    markers = Tokenizer.from_file(str(folder / "tokenizer.json"))
    markers.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")])
    markers.save(str(folder / "tokenizer.json"))
    tok = build_tokenizer(str(folder))
    stops = end_of_turn_ids(load_chat_template("tokenizer", tok), tok)
    assert stops == {tok.eos_id, tok.model.token_to_id("<｜end▁of▁sentence｜>")}


def test_planning_refuses_only_an_absurd_model_size(tmp_path):
    """A config.json describing more than any cluster holds is refused while planning, in one sentence;
    the host's own memory is checked when weights are loaded, not here (the 8B/70B presets above plan
    from folders larger than this host)."""
    import json

    from titanlike.config import load_job_config
    from titanlike.models.llama3 import llama3_flavors
    from titanlike.models.registry import get_model_spec
    from titanlike.train.plan import plan_job

    config = get_model_spec("llama3").hf.args_to_config(llama3_flavors["8B"])
    config.update(num_hidden_layers=2**20, hidden_size=2**20, head_dim=2**20 // config["num_attention_heads"])
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    cfg = load_job_config(["--job.config_file", "train_configs/lora_llama3_8b.toml", "--model.hf_assets_path",
                           str(folder)])
    with pytest.raises(ValueError, match=rf"^{folder}/config.json: the model it describes .* GiB a job may plan for; "
                                         "refusing before allocating it$"):
        plan_job(cfg, 8, vocab_size=128256)
