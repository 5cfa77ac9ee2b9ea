"""Memory estimation and layout planning for titanlike jobs, without GPUs.

Three layers, each usable alone:

- `estimation.analytic`: closed-form bytes per rank (parameters, gradients,
  optimizer state, activations) from the model's shapes and the layout; fast
  enough to score thousands of layouts; dense and mixture-of-experts models (expert
  parallelism, total and active parameters).
- `estimation.traced`: the real model, the real `parallelize_model` and the real
  optimizer, run for one training step under a fake process group and
  FakeTensorMode (nothing is allocated), with torch's memory trackers counting
  every tensor a representative rank would hold (dense models: MoE routing has
  data-dependent sizes a fake tensor cannot give).
- `estimation.planner`: enumerates layouts for a GPU count, drops those that do
  not fit, and ranks the rest by a stated throughput model.

`estimation/estimate.py` and `estimation/plan.py` are the command-line entry points.
"""

from estimation.memory import Breakdown, RankEstimate
from estimation.options import EstimateOptions, PreparedJob, parse_estimate_args, prepare_job

__all__ = [
    "Breakdown",
    "EstimateOptions",
    "PreparedJob",
    "RankEstimate",
    "parse_estimate_args",
    "prepare_job",
]
