"""Reward functions: what users write to score completions, loaded by name, called with care.

A reward function has TRL's signature: `fn(prompts, completions, **columns) -> list[float | None]`,
one value per completion; `columns` are the dataset's other columns, one value per completion
(`answer`, ...), and a function takes what it needs by name and `**kwargs` for the rest. None means
"no reward from this function for this row": it is left out of the weighted sum (TRL's nansum),
and a row with no reward at all is NaN, which the advantages give 0 (objectives/grpo.py
group_advantages).

Functions are named in grpo.reward_funcs: a built-in by its short name (`exact_answer`, `format`,
`reward_model`), or any function as `module:function` (imported with importlib from the job's
Python path). Reward functions run inside the training job, with its privileges.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import math
import numbers
import re
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

RewardFn = Callable[..., Sequence[Any]]


class RewardError(RuntimeError):
    """A reward function failed while training: one sentence naming the function and the prompt."""


@dataclass(frozen=True)
class Reward:
    """A loaded reward function: `name` as the job named it (messages, logs), `fn`, and the dataset
    columns it reads (built-ins say; a user's function reads what it asks for, unchecked)."""

    name: str
    fn: RewardFn
    columns: tuple[str, ...] = ()


# Built-ins -------------------------------------------------------------------------------------

_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[-+]?\.\d+")


def _text(completion: Any) -> str:
    """A completion's text: itself, or a conversation's last message's content (TRL's conversational
    form)."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def last_boxed(text: str) -> str | None:
    r"""The contents of the last \boxed{...} in text (nested braces kept), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def normalize_answer(answer: str) -> str | float:
    """A math answer in a comparable form: a number as a float ("1,000" and "1000.0" are 1000.0),
    anything else with its spaces, dollar signs and final period removed."""
    s = answer.strip().replace("$", "").rstrip(".").strip()
    return float(s.replace(",", "")) if _NUMBER.fullmatch(s) else s.replace(" ", "")


def extract_answer(completion: str) -> str | None:
    r"""The answer a completion gives: its last \boxed{...}, else its last number, else None."""
    boxed = last_boxed(completion)
    if boxed is not None:
        return boxed
    numbers_ = _NUMBER.findall(completion)
    return numbers_[-1] if numbers_ else None


def _reference_answer(answer: Any) -> str:
    r"""The row's answer column as the answer itself: after GSM8K's "####" or inside a \boxed{}."""
    s = str(answer)
    if "####" in s:
        s = s.rsplit("####", 1)[1]
    boxed = last_boxed(s)
    return s if boxed is None else boxed


def exact_answer() -> Reward:
    """1 when the completion's answer (extract_answer) equals the row's `answer` (normalize_answer),
    else 0; None for a row whose answer is None."""
    def exact_answer(prompts, completions, answer, **kwargs) -> list[float | None]:
        out: list[float | None] = []
        for completion, want in zip(completions, answer):
            if want is None:
                out.append(None)
                continue
            got = extract_answer(_text(completion))
            out.append(float(got is not None and normalize_answer(got) == normalize_answer(_reference_answer(want))))
        return out

    return Reward("exact_answer", exact_answer, ("answer",))


def format_reward(pattern: str | None = None, *, max_chars: int = 20_000) -> Reward:
    """1 when the whole completion matches the regular expression `pattern` (re.fullmatch, `.`
    matching newlines), else 0; a completion longer than max_chars scores 0 unmatched, so a costly
    pattern cannot stall the job on a long one."""
    if not pattern:
        raise ValueError("reward format needs a regular expression: set grpo.format_pattern")
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ValueError(f"grpo.format_pattern {pattern!r} is not a regular expression: {e}") from None

    def format(prompts, completions, **kwargs) -> list[float]:  # noqa: A001 (the name users give)
        return [float(len(t) <= max_chars and compiled.fullmatch(t) is not None)
                for t in map(_text, completions)]

    return Reward("format", format)


def _is_hf_score_folder(path: str) -> bool:
    import json
    import os

    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return False
    with open(config) as f:
        return any(a.endswith("ForSequenceClassification") for a in json.load(f).get("architectures") or ())


def reward_model(path: str | None = None, *, tokenizer=None, device: str = "cpu") -> Reward:
    """The score a reward model gives prompt + completion, at its last token: a titanlike checkpoint
    (titanlike.load_model, a model with a scalar head: training.objective reward) or a Hugging Face
    `...ForSequenceClassification` folder (transformers), with the folder's tokenizer unless one is
    given (an object with encode(text, bos=, eos=), as titanlike/data/tokenizer.py's)."""
    if not path:
        raise ValueError("reward reward_model needs a model: set grpo.reward_model_path")
    from titanlike.models.outputs import logits_of

    if _is_hf_score_folder(path):
        import transformers

        hf = transformers.AutoModelForSequenceClassification.from_pretrained(path).to(device).eval()
        score = lambda ids: hf(input_ids=ids).logits[0]  # noqa: E731
    else:
        from titanlike.checkpoint.hf import load_model

        model = load_model(path, device)
        score = lambda ids: logits_of(model(ids))[0, -1]  # noqa: E731
    with torch.no_grad():
        width = score(torch.zeros(1, 1, dtype=torch.long, device=device)).numel()
    if width != 1:
        raise ValueError(f"grpo.reward_model_path {path} is not a reward model: it gives {width} scores per token, "
                         "not one")
    if tokenizer is None:
        from titanlike.data.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(path)

    def reward_model(prompts, completions, **kwargs) -> list[float]:
        scores = []
        with torch.no_grad():
            for prompt, completion in zip(prompts, completions):
                ids = tokenizer.encode(_text(prompt) + _text(completion), bos=True, eos=False)
                scores.append(score(torch.tensor([ids], device=device)).float().item())
        return scores

    return Reward("reward_model", reward_model)


# Short name -> the factory of a built-in (read-only).
BUILTINS: Mapping[str, Callable[..., Reward]] = types.MappingProxyType({
    "exact_answer": exact_answer, "format": format_reward, "reward_model": reward_model})


# Loading ---------------------------------------------------------------------------------------


def load_reward(name: str, **options) -> Reward:
    """The reward function `name`: a built-in (BUILTINS, built with the options it takes: `pattern`
    for format; `path`, `tokenizer`, `device` for reward_model) or `module:function`. ValueError, one
    sentence, for a name that is neither, a module that does not import, a missing attribute or one
    that is not callable."""
    if name in BUILTINS:
        factory = BUILTINS[name]
        accepted = inspect.signature(factory).parameters
        return factory(**{k: v for k, v in options.items() if k in accepted})
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {name!r} is neither a built-in ({', '.join(BUILTINS)}) nor "
                         "module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or an error raised while importing the user's module
        raise ValueError(f"reward function {name!r}: module {module_name} does not import "
                         f"({type(e).__name__}: {e})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward function {name!r}: module {module_name} has no attribute {attr}")
    if not callable(fn):
        raise ValueError(f"reward function {name!r} is a {type(fn).__name__}, not a function")
    return Reward(name, fn)


def load_rewards(names: Sequence[str], **options) -> list[Reward]:
    """load_reward of each name, in order."""
    return [load_reward(name, **options) for name in names]


def check_columns(funcs: Sequence[Reward], columns: Sequence[str]) -> None:
    """ValueError (one sentence) when a reward function reads a dataset column the dataset lacks;
    called when the job is planned, before any process group."""
    for reward in funcs:
        missing = [c for c in reward.columns if c not in columns]
        if missing:
            raise ValueError(f"reward {reward.name} needs the dataset column {missing[0]!r}, which the dataset lacks "
                             f"(its columns: {', '.join(columns) or 'none'})")


# Calling ---------------------------------------------------------------------------------------


def _prompt(prompts: Sequence[Any], i: int) -> str:
    return f"prompt {i} ({_text(prompts[i])[:60]!r})"


def _call(reward: Reward, timeout: float | None, prompts, completions, columns) -> Sequence[Any]:
    """reward.fn on the batch, in a daemon thread given `timeout` seconds. Python cannot stop a thread:
    one past its time limit is left running and the job stops (RewardError)."""
    result: dict[str, Any] = {}

    def run():
        try:
            result["value"] = reward.fn(prompts=prompts, completions=completions, **columns)
        except BaseException as e:  # noqa: BLE001 (handed to the caller, which names the prompt)
            result["error"] = e

    worker = threading.Thread(target=run, name=f"reward {reward.name}", daemon=True)
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        raise RewardError(f"reward {reward.name} did not return within {timeout:g} s on the {len(prompts)} completions "
                          f"from {_prompt(prompts, 0)}; Python cannot stop the thread, so the job stops")
    if "error" in result:
        raise result["error"]
    return result["value"]


def _failing_row(reward: Reward, timeout, prompts, completions, columns) -> int | None:
    """The first row whose call alone raises (to name it when the batch's call raised), or None."""
    for i in range(len(prompts)):
        try:
            _call(reward, timeout, prompts[i:i + 1], completions[i:i + 1], {k: v[i:i + 1] for k, v in columns.items()})
        except RewardError:
            raise
        except Exception:
            return i
    return None


def compute_rewards(funcs: Sequence[Reward], weights: Sequence[float] | None, prompts: Sequence[Any],
                    completions: Sequence[Any], columns: Mapping[str, Sequence[Any]], *,
                    timeout: float | None = 300.0, slow: float = 10.0
                    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Every reward function on the batch: (total (B,), the weighted sum with None left out, NaN for a
    row no function rewarded; per_function (F, B), NaN for None; timings, name -> seconds). weights:
    one per function, None for all 1. A call slower than `slow` seconds is logged as a warning; one
    that raises, returns the wrong count, NaN, inf or a non-number, or runs past `timeout` seconds,
    stops the job with RewardError (one sentence naming the function and the prompt: a function that
    raised on the batch is called again one row at a time to find the row). Each call runs in a worker
    thread; Python cannot kill a thread, so one past its time limit is left running while the job
    stops."""
    b = len(prompts)
    columns = {k: list(v) for k, v in columns.items()}
    per_function = torch.full((len(funcs), b), math.nan, dtype=torch.float32)
    timings: dict[str, float] = {}
    for f, reward in enumerate(funcs):
        start = time.perf_counter()
        try:
            values = _call(reward, timeout, list(prompts), list(completions), columns)
        except RewardError:
            raise
        except Exception as e:
            row = _failing_row(reward, timeout, list(prompts), list(completions), columns)
            where = _prompt(prompts, row) if row is not None else f"the {b} completions from {_prompt(prompts, 0)}"
            raise RewardError(f"reward {reward.name} raised {type(e).__name__} ({e}) on {where}") from e
        timings[reward.name] = elapsed = time.perf_counter() - start
        if elapsed > slow:
            logger.warning(f"reward {reward.name} took {elapsed:.1f} s for {b} completions (over {slow:g} s)")
        if not isinstance(values, Sequence) or isinstance(values, (str, bytes)) or len(values) != b:
            count = len(values) if isinstance(values, Sequence) else type(values).__name__
            raise RewardError(f"reward {reward.name} returned {count} values for {b} completions from "
                              f"{_prompt(prompts, 0)}; it must return one per completion")
        for i, v in enumerate(values):
            if v is None:
                continue
            if not isinstance(v, numbers.Real):
                raise RewardError(f"reward {reward.name} returned {type(v).__name__} {v!r:.40} for "
                                  f"{_prompt(prompts, i)}, not a number or None")
            if not math.isfinite(v):
                raise RewardError(f"reward {reward.name} returned {v} for {_prompt(prompts, i)}; return a finite "
                                  "number, or None for no reward")
            per_function[f, i] = float(v)
    w = torch.ones(len(funcs)) if weights is None or len(weights) == 0 else torch.tensor(list(weights),
                                                                                           dtype=torch.float32)
    if len(w) != len(funcs):
        raise ValueError(f"{len(w)} reward weights for {len(funcs)} reward functions; give one per function")
    total = (per_function * w[:, None]).nansum(0)
    total[per_function.isnan().all(0)] = math.nan
    return total, per_function, timings


__all__ = ["BUILTINS", "Reward", "RewardError", "RewardFn", "check_columns", "compute_rewards", "exact_answer",
           "extract_answer", "format_reward", "last_boxed", "load_reward", "load_rewards", "normalize_answer",
           "reward_model"]
