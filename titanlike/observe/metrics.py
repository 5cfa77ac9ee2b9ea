"""Training metrics: throughput, MFU, memory; printed by rank 0 and written to TensorBoard, JSONL
and Weights & Biases (observe/wandb_run.py).

The console line is the run's progress: step of total, loss, tokens/s, memory and the time left
(ETA: the remaining steps at the mean step time since the previous log, checkpoint saves
included, validation excluded).

MFU follows the 6N + 12*L*H*Q*T FLOPs-per-token convention (N without
embeddings, attention counted as non-causal) divided by the device's dense bf16
peak. A device missing from the table gets no MFU rather than a wrong one.

Mixture-of-experts runs add load-balance figures (train/expert_balance.py): every moe/ key goes
to TensorBoard and JSONL, per layer included, but the console gets one compact summary over all
layers (a 48-layer model has hundreds of per-layer keys). The routes per expert of each MoE layer
become a TensorBoard histogram over expert ids (one bucket per expert).
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time
from datetime import datetime, timedelta

import torch

logger = logging.getLogger("titanlike")

# Dense bf16 peak FLOP/s by device-name fragment (most specific first).
_PEAK_BF16_FLOPS = (
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),  # SXM
    ("H200", 989e12),
    ("H800", 989e12),
    ("GH200", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
)


def device_peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, flops in _PEAK_BF16_FLOPS:
        if fragment in name:
            return flops
    return None


def peak_memory_gib(device: torch.device) -> tuple[str, float]:
    """(label, GiB): CUDA peak reserved memory, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return "memory", torch.cuda.max_memory_reserved(device) / 2**30
    # ru_maxrss is in KiB on Linux.
    return "max_rss", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def format_moe(record: dict) -> str:
    """The console's MoE summary, e.g. 'moe: cv 0.21 min 0.65 max 1.45 drop 0.0% aux 0.0710';
    '' without moe/ figures. Losses appear only when the run has them (the summary omits a loss
    that is off)."""
    if "moe/load_cv" not in record:
        return ""
    parts = [f"cv {record['moe/load_cv']:.2f}", f"min {record['moe/load_min']:.2f}",
             f"max {record['moe/load_max']:.2f}", f"drop {100 * record['moe/dropped']:.1f}%"]
    for key, label in (("moe/aux_loss", "aux"), ("moe/seq_aux_loss", "seq_aux"), ("moe/z_loss", "z")):
        if key in record:
            parts.append(f"{label} {record[key]:.4f}")
    return "moe: " + " ".join(parts)


def add_expert_histogram(writer, tag: str, counts: list[float], step: int) -> None:
    """Routes per expert as a TensorBoard histogram over expert ids: bucket e spans (e-0.5, e+0.5]
    and holds expert e's routes, so the Histograms tab draws the load of every expert in expert
    order (a histogram of the counts themselves would lose which expert is which)."""
    ids = range(len(counts))
    total = sum(counts)
    if total <= 0:
        return  # no routes (e.g. a layer on no rank): an empty histogram only confuses the UI
    used = [e for e in ids if counts[e] > 0]
    writer.add_histogram_raw(
        tag, min=used[0], max=used[-1], num=total,
        sum=sum(e * c for e, c in zip(ids, counts)), sum_squares=sum(e * e * c for e, c in zip(ids, counts)),
        bucket_limits=[e + 0.5 for e in ids], bucket_counts=list(counts), global_step=step)


_CENTURY_S = 100 * 365 * 86400


def format_eta(seconds: float) -> str:
    """'1:02:03' (h:mm:ss), with days when longer: '2 days, 3:04:05'; beyond timedelta's range (a
    training.steps of 2^53) 'over 100 years'."""
    if not math.isfinite(seconds):
        return "?"
    return str(timedelta(seconds=round(seconds))) if seconds < _CENTURY_S else "over 100 years"


def tensorboard_run_folder(base: str, now: datetime | None = None) -> str:
    """Where one launch writes its TensorBoard events: torchtitan's ``<save_tb_folder>/<YYYYmmdd-HHMM>``,
    so that ``tensorboard --logdir <dump_folder>/<save_tb_folder>`` shows each launch (a resumed run too)
    as a run of its own. A launch in the same minute as an earlier one gets the seconds too (``-HHMMSS``)
    rather than mixing its events into that folder."""
    now = now or datetime.now()
    folder = os.path.join(base, now.strftime("%Y%m%d-%H%M"))
    if os.path.exists(folder):
        folder = os.path.join(base, now.strftime("%Y%m%d-%H%M%S"))
    return folder


def sample_markdown(prompt: str, text: str) -> str:
    """A sample as TensorBoard's text plugin shows it (Markdown): the prompt in bold, the model's
    continuation after it, Markdown's special characters escaped."""
    def escape(s: str) -> str:
        return "".join("\\" + c if c in "\\`*_[]#<>" else c for c in s)

    return f"**{escape(prompt)}**{escape(text)}"


class MetricsLogger:
    """Accumulates tokens between logs and reports step metrics (rank 0 writes).

    total_steps: the run's last step, for the progress line's ETA. wandb_run: a started wandb run
    (observe/wandb_run.py) that gets every record. After the run, `last_loss` and `validations`
    ((step, loss) of every validation) feed the end-of-run summary.
    """

    def __init__(self, *, device, flops_per_token, tokens_per_step_per_device, log_freq,
                 is_writer, tb_folder=None, jsonl_path=None, total_steps=None, wandb_run=None):
        self.device = device
        self.total_steps = total_steps
        self._wandb = wandb_run if is_writer else None
        self.last_loss: float | None = None
        self.validations: list[tuple[int, float]] = []
        self.flops_per_token = flops_per_token
        self.tokens_per_step_per_device = tokens_per_step_per_device
        self.log_freq = log_freq
        self.is_writer = is_writer
        self.peak_flops = device_peak_flops(device)
        self._tb = None
        self._jsonl = None
        if is_writer and tb_folder:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tb_folder)
        if is_writer and jsonl_path:
            os.makedirs(os.path.dirname(jsonl_path) or ".", exist_ok=True)
            self._jsonl = open(jsonl_path, "a")
        self._last_time = time.perf_counter()
        self._steps_since = 0
        self._tokens_since = 0.0

    def should_log(self, step: int, last_step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == last_step

    def step_done(self, tokens_per_device: float | None = None) -> None:
        """A step ended; tokens_per_device: its tokens per device when not tokens_per_step_per_device
        (a batch ramp-up's smaller batches)."""
        self._steps_since += 1
        self._tokens_since += self.tokens_per_step_per_device if tokens_per_device is None else tokens_per_device

    def log(self, step: int, *, loss: float, grad_norm: float, lr: float, extra: dict | None = None,
            expert_counts: dict[int, torch.Tensor] | None = None, console: tuple[str, ...] = ()) -> dict:
        """One step's record to the console, TensorBoard and JSONL; extra: more scalars for the record;
        expert_counts: routes per expert of each MoE layer (layer index -> (experts,) tensor), for the
        TensorBoard histograms and the JSONL record; console: keys of extra the console line shows too
        (the objective's reported terms)."""
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        tps = self._tokens_since / elapsed
        seconds_per_step = elapsed / max(self._steps_since, 1)
        self._last_time, self._steps_since, self._tokens_since = now, 0, 0.0
        self.last_loss = loss
        mem_label, mem = peak_memory_gib(self.device)
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tps": tps, mem_label: mem,
                  **(extra or {})}
        if self.peak_flops:
            record["mfu"] = 100.0 * tps * self.flops_per_token / self.peak_flops
        if not self.is_writer:
            return record
        mfu = f"  mfu: {record['mfu']:5.2f}%" if "mfu" in record else ""
        moe = format_moe(record)
        # Loss terms the model reports apart from the loss (e.g. mtp_loss); per target token too.
        shown = [key for key in (extra or {}) if key.endswith("_loss") and "/" not in key]
        shown += [key for key in console if key in (extra or {}) and key not in shown]
        terms = "".join(f"  {key}: {extra[key]:8.4f}" for key in shown)
        of_total, eta = "", ""
        if self.total_steps:
            of_total = f"/{self.total_steps}"
            eta = f"  eta: {format_eta(max(self.total_steps - step, 0) * seconds_per_step)}"
        logger.info(
            f"step: {step:5d}{of_total}  loss: {loss:8.4f}{terms}  grad_norm: {grad_norm:7.4f}  lr: {lr:.3e}  "
            f"tps: {tps:,.0f}{mfu}  {mem_label}: {mem:.2f}GiB{eta}" + (f"  {moe}" if moe else "")
        )
        # Counted on the device; one copy to the host, on the writer and only at log steps.
        counts = {layer: [float(v) for v in c.tolist()] if torch.is_tensor(c) else [float(v) for v in c]
                  for layer, c in (expert_counts or {}).items()}
        if self._tb is not None:
            def tensorboard():
                for key, value in record.items():
                    if key != "step":
                        self._tb.add_scalar(key, value, step)
                for layer, c in counts.items():
                    add_expert_histogram(self._tb, f"moe/layer{layer}/tokens_per_expert", c, step)
                self._tb.flush()

            self._write("_tb", tensorboard)
        if self._jsonl is not None:
            # The counts ride in the JSONL line only, under a key outside moe/ so that every moe/
            # value stays a scalar (as in the returned record): {layer: [routes of expert 0, 1, ...]}.
            line = record if not counts else {
                **record, "tokens_per_expert": {str(layer): [round(v) for v in c] for layer, c in counts.items()}}
            self._write("_jsonl", lambda: (self._jsonl.write(json.dumps(line) + "\n"), self._jsonl.flush()))
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=step)
        return record

    def log_validation(self, step: int, loss: float, tokens: int, accuracy: float | None = None) -> dict:
        """Report a validation run: mean loss per target token, its perplexity, and the accuracy (the
        fraction of targets, next or masked tokens, whose most likely token is right)."""
        perplexity = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709
        record = {"step": step, "validation_loss": loss, "validation_perplexity": perplexity, "validation_tokens": tokens}
        if accuracy is not None:
            record["validation_accuracy"] = accuracy
        self.validations.append((step, loss))
        if not self.is_writer:
            return record
        logger.info(f"validation  step: {step:5d}  loss: {loss:8.4f}  perplexity: {perplexity:,.2f}  "
                    + (f"accuracy: {accuracy:.2%}  " if accuracy is not None else "") + f"tokens: {tokens:,}")
        scalars = {"validation/loss": loss, "validation/perplexity": perplexity}
        if accuracy is not None:
            scalars["validation/accuracy"] = accuracy
        if self._tb is not None:
            self._write("_tb", lambda: ([self._tb.add_scalar(name, value, step) for name, value in scalars.items()],
                                        self._tb.flush()))
        if self._jsonl is not None:
            self._write("_jsonl", lambda: (self._jsonl.write(json.dumps(record) + "\n"), self._jsonl.flush()))
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        # Validation time is not training time: keep it out of the next tokens/s.
        self._last_time = time.perf_counter()
        return record

    def log_samples(self, step: int, samples: list[tuple]) -> dict:
        """Report samples (prompt, continuation), or (prompt, continuation, scores): validation's greedy
        continuations, RL's completions with their rewards ({name: value}). The console, TensorBoard text
        (one tag per sample, samples/<i>, Markdown), metrics.jsonl ({"step", "samples": [{"prompt",
        "text", **scores}]}) and a W&B table."""
        items = [{"prompt": s[0], "text": s[1], **(s[2] if len(s) > 2 else {})} for s in samples]
        record = {"step": step, "samples": items}
        if not self.is_writer:
            return record

        def scores(item: dict) -> str:
            return "".join(f"  {k}: {v:.4g}" for k, v in item.items() if k not in ("prompt", "text"))

        logger.info(f"samples  step: {step:5d}\n" + "\n".join(f"  [{i}] {s['prompt']!r} -> {s['text']!r}{scores(s)}"
                                                            for i, s in enumerate(items)))
        if self._tb is not None:
            # TensorBoard renders Markdown: the prompt in bold, then what the model wrote, both escaped.
            self._write("_tb", lambda: ([self._tb.add_text(f"samples/{i}", sample_markdown(s["prompt"], s["text"])
                                                           + scores(s), step)
                                         for i, s in enumerate(items)], self._tb.flush()))
        if self._jsonl is not None:
            self._write("_jsonl", lambda: (self._jsonl.write(json.dumps(record) + "\n"), self._jsonl.flush()))
        if self._wandb is not None:
            import wandb

            names = list(dict.fromkeys(k for s in items for k in s if k not in ("prompt", "text")))
            self._wandb.log({"samples": wandb.Table(columns=["step", "prompt", "text", *names],
                                                    data=[[step, s["prompt"], s["text"], *(s.get(k) for k in names)]
                                                          for s in items])}, step=step)
        self._last_time = time.perf_counter()  # sampling time is not training time
        return record

    def _write(self, writer: str, write) -> None:
        """One write of a metrics file. A full disk (or any file-system error) during the run stops
        that file, said once, and training goes on: only rank 0 writes, so raising here would strand
        the other ranks in their next collective; the checkpoint saves report a full disk themselves."""
        try:
            write()
        except OSError as e:
            name = "TensorBoard events" if writer == "_tb" else "metrics.jsonl"
            logger.warning(f"metrics: writing the {name} failed ({os.strerror(e.errno) if e.errno else e}); they "
                           "stop here, training goes on")
            handle = getattr(self, writer)
            setattr(self, writer, None)
            try:
                handle.close()
            except OSError:
                pass

    def close(self) -> None:
        if self._tb is not None:
            self._write("_tb", self._tb.close)
        if self._jsonl is not None:
            self._write("_jsonl", self._jsonl.close)
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
