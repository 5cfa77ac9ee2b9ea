"""Assets of the GRPO tests: the reverse-words task (tests/sft_assets.py) as prompt rows with an answer
column, and its exact-match reward, a user's reward function (`grpo_assets:exact_text`)."""

from __future__ import annotations


def _text(completion) -> str:
    if isinstance(completion, list):  # a conversation's completion: the assistant's message
        return str(completion[-1]["content"])
    return str(completion)


def exact_text(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the completion, stripped, is the row's answer exactly, else 0 (sft_assets.exact_match's rule)."""
    return [float(_text(c).strip() == a) for c, a in zip(completions, answer)]


def prompt_rows(conversations: list[dict]) -> list[dict]:
    """SFT conversations (user, assistant) as GRPO rows: the user's turn as the prompt, the assistant's
    answer as the answer column."""
    return [{"prompt": c["messages"][:1], "answer": c["messages"][1]["content"]} for c in conversations]


def length_reward(prompts, completions, **kwargs) -> list[float]:
    """A reward every completion of an untrained model varies in (its length in characters, over 10):
    nonzero advantages, so the plumbing tests train on real gradients."""
    return [len(_text(c)) / 10 for c in completions]


def length_unless_red(prompts, completions, answer, **kwargs) -> list[float]:
    """length_reward, but 0 for every completion of a prompt whose answer holds "red": those groups'
    rewards are all equal, so dynamic sampling drops them (the rollout's figures and the trained rows'
    then differ)."""
    return [0.0 if "red" in a else len(_text(c)) / 10 for c, a in zip(completions, answer)]
def odd_answer_length_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """length_reward for the rows whose answer has an odd number of characters, 0 for the others: about
    half of the groups have equal rewards, which dynamic sampling drops and refills."""
    return [len(_text(c)) / 10 if len(a) % 2 else 0.0 for c, a in zip(completions, answer)]
