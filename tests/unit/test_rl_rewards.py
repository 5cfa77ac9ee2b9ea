"""Reward functions (titanlike/rl/rewards.py): loading by name, the built-ins, and compute_rewards'
rules (None left out of the weighted sum, one sentence naming the function and the prompt for a
reward that fails, the slow-call warning, the time limit, the columns a built-in needs)."""

from __future__ import annotations

import dataclasses
import logging
import math
import threading

import pytest
import torch

from titanlike.rl.rewards import (Reward, RewardError, check_columns, compute_rewards, extract_answer, load_reward,
                                  load_rewards, normalize_answer)

PROMPTS = ["What is 2 + 2? Think step by step and put the answer in a box at the very end, please.", "Name a prime.",
           "Spell 'cat'."]
COMPLETIONS = ["2 + 2 = 4, so \\boxed{4}", "7", "c-a-t"]
FIRST = "'What is 2 + 2? Think step by step and put the answer in a bo'"  # its first 60 characters


def one_sentence(e: pytest.ExceptionInfo) -> str:
    text = str(e.value)
    assert "\n" not in text and text.count(". ") == 0, text
    return text


# Loading ---------------------------------------------------------------------------------------


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
        "NOT_CALLABLE = 3\n")
    (tmp_path / "broken_rewards.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_rewards"


def test_a_user_function_loads_by_module_and_name(user_module):
    reward = load_reward("my_rewards:length")
    assert reward.name == "my_rewards:length" and reward.columns == ()
    assert reward.fn(prompts=["p"], completions=["abc"]) == [3.0]


@pytest.mark.parametrize("name, message", [
    ("length", "reward function 'length' is neither a built-in (exact_answer, format, reward_model) nor "
               "module:function"),
    ("my_rewards:", "is neither a built-in"),
    ("no_such_module_here:length", "module no_such_module_here does not import (ModuleNotFoundError"),
    ("broken_rewards:length", "module broken_rewards does not import (RuntimeError: boom)"),
    ("my_rewards:missing", "module my_rewards has no attribute missing"),
    ("my_rewards:NOT_CALLABLE", "reward function 'my_rewards:NOT_CALLABLE' is a int, not a function"),
])
def test_a_bad_name_is_one_sentence(user_module, name, message):
    with pytest.raises(ValueError) as e:
        load_reward(name)
    assert message in one_sentence(e)


def test_builtins_load_by_short_name_with_their_options():
    rewards = load_rewards(["exact_answer", "format"], pattern=r"\d+")
    assert [r.name for r in rewards] == ["exact_answer", "format"]
    assert rewards[0].columns == ("answer",)


# Built-ins -------------------------------------------------------------------------------------


@pytest.mark.parametrize("completion, answer, reward", [
    ("The total is 1,000.", "1000", 1.0),
    ("so the answer is \\boxed{3.0}", "3", 1.0),
    ("first 5, then finally 7", "5", 0.0),  # the last number is the answer
    ("first 5, then finally 7", "7", 1.0),
    ("\\boxed{\\frac{1}{2}} and 9 more words", "\\frac{1}{2}", 1.0),  # a box wins over a later number
    ("\\boxed{x^{2} + 1}", "x^{2}+1", 1.0),
    ("She pays $18 every day.", "Janet sells 16 - 3 - 4 = 9 eggs... 9 * 2 = 18\n#### 18", 1.0),  # GSM8K's answer
    ("-2.50", "-2.5", 1.0),
    ("no number here", "4", 0.0),
    ("42", None, None),  # no answer for this row: no reward
    ([{"role": "assistant", "content": "it is 12"}], "12", 1.0),  # a conversational completion
])
def test_exact_answer(completion, answer, reward):
    fn = load_reward("exact_answer").fn
    assert fn(prompts=["q"], completions=[completion], answer=[answer]) == [reward]


def test_answer_normalization():
    assert normalize_answer("1,000") == normalize_answer("1000.0") == 1000.0
    assert normalize_answer(" 3. ") == 3.0 and normalize_answer("$5") == 5.0
    assert extract_answer("a \\boxed{1} b \\boxed{2}") == "2" and extract_answer("none") is None


def test_format_is_a_full_match_with_a_length_cap():
    reward = load_reward("format", pattern=r"<think>.*</think>\s*<answer>\d+</answer>")
    good, partial = "<think>a\nb</think> <answer>4</answer>", "<think>a</think> <answer>4</answer> and more"
    assert reward.fn(prompts=["q"] * 2, completions=[good, partial]) == [1.0, 0.0]
    from titanlike.rl.rewards import format_reward

    capped = format_reward(r"a*", max_chars=10)
    assert capped.fn(prompts=["q"] * 2, completions=["a" * 10, "a" * 11]) == [1.0, 0.0]


@pytest.mark.parametrize("pattern, message", [
    (None, "reward format needs a regular expression: set grpo.format_pattern"),
    ("(unclosed", "grpo.format_pattern '(unclosed' is not a regular expression"),
])
def test_format_needs_a_valid_pattern(pattern, message):
    with pytest.raises(ValueError) as e:
        load_reward("format", pattern=pattern)
    assert message in one_sentence(e)


class WordTokenizer:
    """Token i for the word "t{i}"; what reward_model asks of a tokenizer."""

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        return [0] * bos + [int(w[1:]) for w in text.split()] + [1] * eos


def tiny_reward_model(head: bool = True):
    from titanlike.models.registry import get_model_spec

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel_tiny"], n_layers=1, vocab_size=64, max_seq_len=64)
    args = args.with_score_head() if head else args
    with torch.device("meta"):
        model = spec.model_cls(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    return spec, args, model.eval()


@pytest.mark.parametrize("kind", ["dcp", "hf"])
def test_reward_model_scores_prompt_and_completion_at_the_last_token(kind, tmp_path):
    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import write_hf
    from titanlike.checkpoint.hf import write_dcp_model

    spec, args, model = tiny_reward_model()
    if kind == "dcp":
        write_dcp_model(dict(model.state_dict()), str(tmp_path), {"contents": "model_only", "step": 0,
                                                                  "model": model_description("llama3", args)})
    else:
        pytest.importorskip("transformers")
        write_hf(dict(model.state_dict()), spec, args, str(tmp_path), context_len=64, bos_id=0, eos_id=1, pad_id=2)
    reward = load_reward("reward_model", path=str(tmp_path), tokenizer=WordTokenizer())
    prompts, completions = ["t5 t6", "t7"], [" t8 t9", " t10 t11 t12"]
    got = reward.fn(prompts=prompts, completions=completions)
    with torch.no_grad():
        want = [model(torch.tensor([[0, 5, 6, 8, 9]]))[0, -1, 0].item(),
                model(torch.tensor([[0, 7, 10, 11, 12]]))[0, -1, 0].item()]
    assert got == pytest.approx(want, abs=1e-4)
    assert got[0] != got[1]


def test_a_language_model_is_not_a_reward_model(tmp_path):
    from titanlike.checkpoint.format import model_description
    from titanlike.checkpoint.hf import write_dcp_model

    _, args, model = tiny_reward_model(head=False)
    write_dcp_model(dict(model.state_dict()), str(tmp_path), {"contents": "model_only", "step": 0,
                                                              "model": model_description("llama3", args)})
    with pytest.raises(ValueError) as e:
        load_reward("reward_model", path=str(tmp_path), tokenizer=WordTokenizer())
    assert "is not a reward model: it gives 64 scores per token, not one" in one_sentence(e)
    with pytest.raises(ValueError, match="reward reward_model needs a model: set grpo.reward_model_path"):
        load_reward("reward_model")


# compute_rewards -------------------------------------------------------------------------------


def constant(name: str, values) -> Reward:
    return Reward(name, lambda prompts, completions, **kwargs: list(values))


def test_weighted_sum_leaves_none_out():
    funcs = [constant("a", [1.0, None, None]), constant("b", [2.0, 3.0, None])]
    total, per_function, timings = compute_rewards(funcs, [1.0, 0.5], PROMPTS, COMPLETIONS, {})
    assert per_function.shape == (2, 3) and per_function[0, 1].isnan()
    assert total[:2].tolist() == [2.0, 1.5]  # 1 + 0.5 * 2; None of a ignored: 0.5 * 3
    assert math.isnan(total[2])  # no reward at all: NaN, which group_advantages turns into 0
    assert set(timings) == {"a", "b"} and all(t >= 0 for t in timings.values())
    total, _, _ = compute_rewards(funcs, None, PROMPTS, COMPLETIONS, {})  # weights default to 1
    assert total[0] == 3.0


def test_columns_reach_the_function():
    seen = {}

    def fn(prompts, completions, answer, level, **kwargs):
        seen.update(answer=answer, level=level)
        return [0.0] * len(prompts)

    compute_rewards([Reward("fn", fn)], None, PROMPTS, COMPLETIONS, {"answer": ("4", "7", "cat"), "level": [1, 2, 3]})
    assert seen == {"answer": ["4", "7", "cat"], "level": [1, 2, 3]}


def fails_on_prime(prompts, completions, **kwargs):
    return [1.0 / (0 if "prime" in p else 1) for p in prompts]


@pytest.mark.parametrize("reward, message", [
    (Reward("fails_on_prime", fails_on_prime),
     "reward fails_on_prime raised ZeroDivisionError (float division by zero) on prompt 1 ('Name a prime.')"),
    (constant("short", [1.0, 2.0]), f"reward short returned 2 values for 3 completions from prompt 0 ({FIRST}); it "
                                    "must return one per completion"),
    (Reward("scalar", lambda prompts, completions, **kwargs: 1.0), "reward scalar returned float values for 3 "
                                                                   "completions"),
    (constant("nan", [1.0, 2.0, float("nan")]),
     "reward nan returned nan for prompt 2 (\"Spell 'cat'.\"); return a finite"),
    (constant("inf", [float("inf"), 2.0, 3.0]), f"reward inf returned inf for prompt 0 ({FIRST})"),
    (constant("text", [1.0, "1", 3.0]), "reward text returned str '1' for prompt 1 ('Name a prime.'), not a number"),
])
def test_a_failing_reward_stops_with_one_sentence_naming_it_and_the_prompt(reward, message):
    with pytest.raises(RewardError) as e:
        compute_rewards([constant("fine", [0.0] * 3), reward], None, PROMPTS, COMPLETIONS, {})
    assert message in one_sentence(e)


def test_a_slow_reward_is_a_warning(caplog):
    import time

    def slow(prompts, completions, **kwargs):
        time.sleep(0.05)
        return [1.0] * len(prompts)

    with caplog.at_level(logging.WARNING, logger="titanlike.rl.rewards"):
        total, _, timings = compute_rewards([Reward("slow", slow), constant("quick", [0.0] * 3)], None, PROMPTS,
                                            COMPLETIONS, {}, slow=0.03)
    assert total.tolist() == [1.0, 1.0, 1.0] and timings["slow"] >= 0.05
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and warnings[0].startswith("reward slow took") and "over 0.03 s" in warnings[0]


def test_a_reward_past_its_time_limit_stops_the_job():
    release = threading.Event()

    def stuck(prompts, completions, **kwargs):
        release.wait(30)
        return [0.0] * len(prompts)

    try:
        with pytest.raises(RewardError) as e:
            compute_rewards([Reward("stuck", stuck)], None, PROMPTS, COMPLETIONS, {}, timeout=0.2)
        assert f"reward stuck did not return within 0.2 s on the 3 completions from prompt 0 ({FIRST})" in \
            one_sentence(e)
        assert "Python cannot stop the thread, so the job stops" in str(e.value)
    finally:
        release.set()


def test_check_columns_names_the_missing_column():
    funcs = [load_reward("exact_answer"), Reward("user", fails_on_prime)]
    check_columns(funcs, ["prompt", "answer"])
    with pytest.raises(ValueError) as e:
        check_columns(funcs, ["prompt", "solution"])
    assert one_sentence(e) == ("reward exact_answer needs the dataset column 'answer', which the dataset lacks (its "
                               "columns: prompt, solution)")
