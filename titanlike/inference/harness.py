"""An lm-evaluation-harness model for titanlike checkpoints: `--model titanlike` (titanlike-eval or
scripts/eval.py registers it; lm-eval 0.4 loads no model plugins by itself: its registry reads no
entry points). Importing this module registers it too, for lm-eval from Python:

    import lm_eval
    import titanlike.inference.harness  # noqa: F401  (registers model="titanlike")
    lm_eval.simple_evaluate(model="titanlike", model_args="checkpoint=outputs/checkpoint", tasks=["hellaswag"])

    titanlike-eval --model titanlike --model_args checkpoint=outputs/checkpoint,tokenizer=tok/ \\
        --tasks hellaswag --batch_size 8

model_args: checkpoint (a DCP step folder, a checkpoint folder of step-N folders, or a Hugging Face
folder), tokenizer (default: the checkpoint folder's tokenizer.json, else the debug tokenizer),
dtype (float32, bfloat16, float16; default as stored), max_length (default: the model's context),
max_gen_toks (default 256), add_bos_token (true: a text starts with BOS; false: with nothing; default:
as the model's exported tokenizer starts it, which lm-eval's `hf` model does on the export: Llama BOS,
GPT-2 nothing; inference/processor.py prompt_framing); lm-eval's --device (default: cuda
when there is a GPU, else cpu). Checkpoint, tokenizer, dtype and device mean what they mean to
titanlike-generate and titanlike-serve (inference/loading.py).

The three requests follow lm-eval's `hf` model, so that the same checkpoint scores the same there
(tests/integration/test_lm_eval.py compares them on its Hugging Face export):
- loglikelihood: context and continuation encoded together and split after the context's tokens;
  a sequence longer than max_length + 1 keeps its last tokens (left truncation); one forward per
  batch of right-padded sequences (a causal model's positions never see the padding after them).
- loglikelihood_rolling: lm-eval's disjoint windows of max_length tokens, the first conditioned on
  the prefix token (BOS), each window scored as a loglikelihood.
- generate_until: the KV-cache engine (titanlike/inference/engine.py), greedy or sampled as the
  request asks, ending at EOS, at a stop string (the text cut before it) or after max_gen_toks; the
  context keeps its last max_length - max_gen_toks tokens.

Decoder-only models only: an encoder (BERT) has no next token to score and an encoder-decoder (T5)
scores a continuation in its decoder, which this model does not do; both are refused in one sentence.

Tensor parallel: under torchrun every rank loads the checkpoint and keeps its shard (the family's
sharding plan over all ranks, logits gathered); every rank runs every request and reports rank 0,
world size 1, lm-eval's convention for tensor-parallel launchers (only LOCAL_RANK 0 writes results).
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from titanlike.inference.engine import Engine, GenerationError
from titanlike.inference.loading import choose_device, load_for_inference, model_dtype, model_spec
from titanlike.inference.processor import Processor
from titanlike.inference.sampling import SamplingParams
from titanlike.observe.progress import progress


def _flag(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("true", "1", "yes"):
        return True
    if str(value).lower() in ("false", "0", "no"):
        return False
    raise GenerationError(f"model_args {name} must be true or false, got {value!r}")


def _count(name: str, value, *, minimum: int = 1) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = None
    if number is None or isinstance(value, bool) or str(number) != str(value).strip() or number < minimum:
        raise GenerationError(f"{name} must be an integer of at least {minimum}, got {value!r}")
    return number


def _decoder_only(model) -> None:
    """GenerationError, one sentence, for a model that cannot score a continuation token by token."""
    from titanlike.inference.loading import training_objective
    from titanlike.models import protocol

    objective = training_objective(model)
    name = type(model).__name__
    if protocol.generation_hooks(model) is None:
        raise GenerationError(f"{name} cannot be evaluated with lm-evaluation-harness: it is an encoder trained on "
                              f"{objective.name} samples, and the titanlike model scores and continues text with "
                              "decoder-only models")
    if objective.generation is None:
        raise GenerationError(f"{name} cannot be evaluated with the titanlike lm-evaluation-harness model: it is an "
                              f"encoder-decoder trained on {objective.name} samples, and the titanlike model scores "
                              "text with decoder-only models")


def _tensor_parallel(model, device: torch.device):
    """The model sharded over every rank of the default process group by its family's plan, with
    the weights of `model` (every rank holds them all) and gathered logits."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, distribute_tensor

    from titanlike.parallel.tensor_parallel import apply_tensor_parallel

    spec = model_spec(model)
    world = torch.distributed.get_world_size()
    if spec.shard is None:
        raise GenerationError(f"{type(model).__name__} has no tensor-parallel plan; evaluate it on one process")
    mesh = init_device_mesh(device.type, (world,))
    dtype = next(model.parameters()).dtype
    with torch.device("meta"):
        sharded = spec.model_cls(model.model_args)
    apply_tensor_parallel(sharded, mesh, spec.shard, loss_parallel=False, sequence_parallel=False)
    sharded.to_empty(device=device)
    sharded.to(dtype)
    sharded.init_weights(seed=0)  # the non-persistent buffers (RoPE tables); the weights are copied below
    full = model.state_dict()
    with torch.no_grad():
        for name, value in sharded.state_dict().items():
            source = full[name].to(device=device, dtype=value.dtype)
            if isinstance(value, DTensor):
                value.to_local().copy_(distribute_tensor(source, value.device_mesh, value.placements).to_local())
            else:
                value.copy_(source)
    return sharded.eval()


class TitanlikeLM(TemplateLM):
    """lm-eval's LM over a titanlike checkpoint (see the module's docstring)."""

    backend = "causal"

    def __init__(self, checkpoint: str | None = None, tokenizer: str | None = None, batch_size=1,
                 max_batch_size=None, device: str | None = None, dtype: str | None = None, max_length=None,
                 max_gen_toks=256, add_bos_token=None, **unknown):
        super().__init__()
        if any(key.startswith(("pipeline_parallel", "pp")) for key in unknown):
            # Why not: inference/loading.py, above PIPELINE_REFUSAL.
            from titanlike.inference.loading import PIPELINE_REFUSAL

            raise GenerationError(f"evaluation {PIPELINE_REFUSAL}")
        if unknown:
            raise GenerationError(f"the titanlike model takes no model_args {', '.join(sorted(unknown))} (it takes "
                                  "checkpoint, tokenizer, dtype, max_length, max_gen_toks, add_bos_token)")
        if not checkpoint:
            raise GenerationError("the titanlike model needs model_args checkpoint=PATH (a DCP step folder, a "
                                  "checkpoint folder or a Hugging Face folder)")
        torch_dtype = model_dtype(dtype, option="model_args dtype")
        if str(batch_size).startswith("auto"):
            raise GenerationError("the titanlike model takes a number as batch_size, not auto")
        self._batch_size = _count("batch_size", batch_size)
        self._max_gen_toks = _count("max_gen_toks", max_gen_toks)
        self.add_bos_token = None if add_bos_token is None else _flag("add_bos_token", add_bos_token)
        self._device = choose_device(device, option="device")
        load_on = "cpu" if self._tensor_parallel() else self._device
        model, tok = load_for_inference(checkpoint, tokenizer=tokenizer, device=load_on, dtype=torch_dtype,
                                        accept=_decoder_only)
        # The tokenizer and the stop ids generate_until ends at, as generate and serve have them.
        self.processor = Processor.for_model(model, tok)
        self.tokenizer = self.processor.tokenizer
        self.model = _tensor_parallel(model, self._device) if self._tensor_parallel() else model
        context = self.model.model_args.context_len
        self._max_length = _count("max_length", max_length) if max_length is not None else context
        if self._max_length > context:
            raise GenerationError(f"max_length {self._max_length} is longer than the model's context of {context} "
                                  "tokens")
        self.engine = Engine(self.model, context_len=self._max_length)
        self.special_ids = self.tokenizer.special_ids
        self.bos_text = self.tokenizer.decode([self.tokenizer.bos_id])
        # What a text starts with: the ids the export's tokenizer puts first, or BOS as add_bos_token
        # says. (What it puts last, T5's EOS, belongs to encoder-decoders, which are refused.)
        bos = (self.tokenizer.bos_id,)
        self.prefix = {None: self.processor.framing.before, True: bos, False: ()}[self.add_bos_token]

    @staticmethod
    def _tensor_parallel() -> bool:
        """Whether this process is one rank of several (torchrun, or a group already made)."""
        import torch.distributed as dist

        if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1

    # ------------------------------------------------------------------------- lm-eval's interface

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        # As lm-eval's hf model: the tokenizer's start (self.prefix) unless the text starts with BOS;
        # special-token strings in the text are those tokens (as transformers encodes them).
        prefix = self.prefix if add_special_tokens is None else self.processor.framing.before
        if add_special_tokens is False or (add_special_tokens is None and string.startswith(self.bos_text)):
            prefix = ()
        return list(prefix) + self.tokenizer.encode(string, bos=False, eos=False, allowed_special="all")

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        tokens = [tokens] if isinstance(tokens, int) else list(tokens)
        if skip_special_tokens:
            tokens = [t for t in tokens if t not in self.special_ids]
        return self.tokenizer.decode(tokens)

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Log-probabilities (batch, longest, vocab), float32, of right-padded rows in one forward."""
        from torch.distributed.tensor import DTensor

        from titanlike.models.outputs import logits_of

        longest = max(len(r) for r in rows)
        batch = torch.zeros(len(rows), longest, dtype=torch.long)
        for i, row in enumerate(rows):
            batch[i, :len(row)] = torch.tensor(row)
        logits = logits_of(self.model(batch.to(self.device)))
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        return F.log_softmax(logits.float(), dim=-1)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, desc: str = "lm-eval: loglikelihood",
                              **kwargs) -> list[tuple[float, bool]]:
        """(log-probability of the continuation, whether greedy decoding gives it) per request of
        (key, context ids, continuation ids), batch_size requests per forward, longest first; a
        progress bar over the requests (titanlike/observe/progress.py) unless disable_tqdm."""
        inputs = []
        for _, context, continuation in requests:
            if not continuation:
                raise GenerationError("a loglikelihood request has an empty continuation: nothing to score")
            if len(continuation) > self.max_length:
                raise GenerationError(f"a continuation of {len(continuation)} tokens is longer than the model's "
                                      f"context of {self.max_length} tokens")
            # Left truncation: the last max_length tokens of context + continuation, the final one only
            # predicted.
            inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
        order = sorted(range(len(requests)), key=lambda i: (-len(inputs[i]) - 1, inputs[i]))
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        bar = progress(desc=desc, total=len(order), unit=" requests", enabled=not disable_tqdm)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            logprobs = self._logits([inputs[i] for i in chunk])
            bar.update(len(chunk))
            for row, i in enumerate(chunk):
                continuation = requests[i][2]
                length = len(inputs[i])
                scores = logprobs[row, length - len(continuation):length]
                target = torch.tensor(continuation, device=scores.device)
                greedy = bool((scores.argmax(-1) == target).all())
                results[i] = (float(scores.gather(1, target[:, None]).sum()), greedy)
        bar.close()
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """The log-probability of each whole text, in disjoint windows of max_length tokens (lm-eval's)."""
        windows, owners = [], []
        for index, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        scored = self._loglikelihood_tokens(windows, disable_tqdm, desc="lm-eval: loglikelihood_rolling (windows)")
        for owner, (logprob, _) in zip(owners, scored):
            totals[owner] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's continuation through the KV-cache engine; requests of the same generation
        arguments share batches of batch_size, longest first."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[repr(sorted(req.args[1].items(), key=lambda kv: kv[0]))].append(i)
        results: list[str | None] = [None] * len(requests)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        bar = progress(desc="lm-eval: generate_until", total=len(requests), unit=" requests", enabled=not disable_tqdm)
        for members in groups.values():
            kwargs = normalize_gen_kwargs(requests[members[0]].args[1], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            params = self._sampling(kwargs, until)
            keep = self.max_length - params.max_new_tokens
            if keep < 1:
                raise GenerationError(f"max_gen_toks {params.max_new_tokens} leaves no room for a context in the "
                                      f"model's {self.max_length} tokens")
            prompts = {i: self.tok_encode(requests[i].args[0])[-keep:] for i in members}
            order = sorted(members, key=lambda i: (-len(prompts[i]), requests[i].args[0]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start:start + self.batch_size]
                completions, _ = self.engine.generate([prompts[i] for i in chunk], params,
                                                      detokenize=self.tok_decode)
                bar.update(len(chunk))
                for i, completion in zip(chunk, completions):
                    text = postprocess_generated_text(self.tok_decode(completion.tokens), stop=until,
                                                      think_end_token=None)
                    results[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        bar.close()
        return results

    def _sampling(self, kwargs: dict, until: list[str]) -> SamplingParams:
        """SamplingParams of a request's normalized generation arguments; one sentence for others."""
        max_new = kwargs.pop("max_gen_toks")
        kwargs.pop("do_sample", None)
        temperature = kwargs.pop("temperature", 0.0) or 0.0
        fields = {"top_k": kwargs.pop("top_k", 0) or 0, "top_p": kwargs.pop("top_p", 1.0) or 1.0,
                  "repetition_penalty": kwargs.pop("repetition_penalty", 1.0) or 1.0, "seed": kwargs.pop("seed", None)}
        if kwargs:
            raise GenerationError(f"the titanlike model does not take the generation arguments "
                                  f"{', '.join(sorted(kwargs))}")
        try:
            return SamplingParams(max_new_tokens=max_new, temperature=float(temperature), **fields,
                                  stop_token_ids=self.processor.stop_ids(chat=False),
                                  stop_strings=tuple(dict.fromkeys(s for s in until if s)))
        except ValueError as e:
            raise GenerationError(f"generation arguments: {e}") from None


MODEL_NAME = "titanlike"
if MODEL_NAME not in model_registry:  # titanlike.cli.eval.register may have named this class already
    model_registry.register(MODEL_NAME, target=TitanlikeLM)

__all__ = ["MODEL_NAME", "TitanlikeLM"]
