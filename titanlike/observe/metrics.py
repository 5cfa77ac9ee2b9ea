"""Training metrics: throughput, MFU, memory; printed by rank 0 and written to TensorBoard/JSONL.

MFU follows the 6N + 12*L*H*Q*T FLOPs-per-token convention (N without
embeddings, attention counted as non-causal) divided by the device's dense bf16
peak. A device missing from the table gets no MFU rather than a wrong one.
"""

from __future__ import annotations

import json
import logging
import math
import os
import resource
import time

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


class MetricsLogger:
    """Accumulates tokens between logs and reports step metrics (rank 0 writes)."""

    def __init__(self, *, device, flops_per_token, tokens_per_step_per_device, log_freq,
                 is_writer, tb_folder=None, jsonl_path=None):
        self.device = device
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

    def should_log(self, step: int, last_step: int) -> bool:
        return step == 1 or step % self.log_freq == 0 or step == last_step

    def step_done(self) -> None:
        self._steps_since += 1

    def log(self, step: int, *, loss: float, grad_norm: float, lr: float, extra: dict | None = None) -> dict:
        """One step's record to the console, TensorBoard and JSONL; extra: more scalars for the record."""
        now = time.perf_counter()
        elapsed = max(now - self._last_time, 1e-9)
        tps = self._steps_since * self.tokens_per_step_per_device / elapsed
        self._last_time, self._steps_since = now, 0
        mem_label, mem = peak_memory_gib(self.device)
        record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tps": tps, mem_label: mem,
                  **(extra or {})}
        if self.peak_flops:
            record["mfu"] = 100.0 * tps * self.flops_per_token / self.peak_flops
        if not self.is_writer:
            return record
        mfu = f"  mfu: {record['mfu']:5.2f}%" if "mfu" in record else ""
        logger.info(
            f"step: {step:5d}  loss: {loss:8.4f}  grad_norm: {grad_norm:7.4f}  lr: {lr:.3e}  "
            f"tps: {tps:,.0f}{mfu}  {mem_label}: {mem:.2f}GiB"
        )
        if self._tb is not None:
            for key, value in record.items():
                if key != "step":
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        return record

    def log_validation(self, step: int, loss: float, tokens: int) -> dict:
        """Report a validation run: mean loss per target token and its perplexity."""
        perplexity = math.exp(loss) if loss < 700 else math.inf  # exp overflows a float past ~709
        record = {"step": step, "validation_loss": loss, "validation_perplexity": perplexity, "validation_tokens": tokens}
        if not self.is_writer:
            return record
        logger.info(f"validation  step: {step:5d}  loss: {loss:8.4f}  perplexity: {perplexity:,.2f}  "
                    f"tokens: {tokens:,}")
        if self._tb is not None:
            self._tb.add_scalar("validation/loss", loss, step)
            self._tb.add_scalar("validation/perplexity", perplexity, step)
            self._tb.flush()
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        # Validation time is not training time: keep it out of the next tokens/s.
        self._last_time = time.perf_counter()
        return record

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()
