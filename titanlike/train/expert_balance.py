"""Once per optimizer step, the bookkeeping of a mixture-of-experts model's layers.

Every MoE layer counts, during the step's training forwards, the routes each expert got, the routes
dropped over capacity and the values of its balancing losses (models/common/moe.py). After the
step, one all-reduce over all ranks turns those into a (layers x (experts + stats)) table:

  - each row is summed over the ranks holding that layer (they all routed different tokens:
    data, context and tensor-parallel ranks), and rows of layers on other pipeline stages come in
    as they are, so every rank sees every layer; a stage without MoE layers adds zeros, so no
    rank waits on a collective the others skip (the hang Megatron users met on dense stages);
  - aux-loss-free balancing moves each layer's expert bias by bias_update_rate towards the mean
    load: +rate for experts below the mean, -rate above, centred (as DeepSeek-V3 / torchtitan);
  - the table gives the load-balance figures the metrics log (titanlike/observe/metrics.py).

The table size comes from the model args, not from what this rank holds.
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist
import torch.nn as nn

from titanlike.models.common.init import canonical_fqn
from titanlike.models.common.moe import STAT_NAMES, MoE, MoEArgs, moe_layers

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ExpertBalance:
    def __init__(self, model_parts: list[nn.Module], moe: MoEArgs, num_layers: int, device: torch.device,
                 group: dist.ProcessGroup | None):
        self.args = moe
        self.num_layers = num_layers
        self.device = device
        self.group = group
        self.layers: dict[int, MoE] = {}
        for part in model_parts:
            for name, layer in moe_layers(part):
                match = _LAYER.search(canonical_fqn(name) + ".")
                if match is None:
                    raise ValueError(f"MoE layer {name} is not inside model.layers")
                self.layers[int(match.group(1))] = layer

    def step_done(self, *, applied: torch.Tensor) -> torch.Tensor:
        """Collect and reset this step's counts; update the biases unless the step was skipped
        (applied: a device bool, so nothing is read back to the host). Returns the table
        (num_layers, experts + len(STAT_NAMES)), on every rank; the rows of dense layers are zero."""
        e = self.args.num_experts
        table = torch.zeros(self.num_layers, e + len(STAT_NAMES), device=self.device)
        for index, layer in self.layers.items():
            table[index, :e] = layer.tokens_per_expert
            table[index, e:] = layer.step_stats
            layer.tokens_per_expert.zero_()
            layer.step_stats.zero_()
        if self.group is not None:
            dist.all_reduce(table, group=self.group)
        rate = self.args.bias_update_rate
        if rate > 0:
            keep = applied.to(table.dtype)
            with torch.no_grad():
                for index, layer in self.layers.items():
                    counts = table[index, :e]
                    delta = rate * torch.sign(counts.mean() - counts)
                    layer.expert_bias += (delta - delta.mean()) * keep
        return table

    def summary(self, table: torch.Tensor, global_tokens: float) -> dict[str, float]:
        """Load-balance figures of one step: per MoE layer (moe/layer{i}/...) and over all layers.

        load_cv: coefficient of variation of the routes per expert; load_min / load_max: the least
        and most loaded expert relative to the mean (1 is perfect balance); dropped: fraction of
        routes dropped over capacity; the balancing losses per target token (the units of the
        logged loss).
        """
        e = self.args.num_experts
        out: dict[str, float] = {}
        rows = [i for i in range(self.num_layers) if self.args.is_moe_layer(i)]
        if not rows:
            return out
        counts = table[rows, :e].double()
        mean = counts.mean(1).clamp_min(1e-12)
        stats = {name: table[rows, e + j].double() for j, name in enumerate(STAT_NAMES)}
        per_layer = {
            "load_cv": counts.std(1, unbiased=False) / mean,
            "load_min": counts.min(1).values / mean,
            "load_max": counts.max(1).values / mean,
            "dropped": stats["dropped"] / stats["routes"].clamp_min(1),
        }
        for name in ("aux_loss", "seq_aux_loss", "z_loss"):
            if stats[name].abs().sum() > 0:
                per_layer[name] = stats[name] / global_tokens
        for name, values in per_layer.items():
            if name == "load_max":
                overall = values.max()
            elif name == "load_min":
                overall = values.min()
            elif name.endswith("loss"):
                overall = values.sum()  # the layers' losses add up in the objective
            else:
                overall = values.mean()
            out[f"moe/{name}"] = float(overall)
            for row, value in zip(rows, values.tolist()):
                out[f"moe/layer{row}/{name}"] = value
        return out


__all__ = ["ExpertBalance"]
