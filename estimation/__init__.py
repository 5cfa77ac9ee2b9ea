"""Memory estimation and layout planning for titanlike jobs, without GPUs.

- `estimation.probe`: the job's own training step (TrainStep on the parallelized model, the real
  optimizer) on fake tensors under a fake process group, one block of each kind, measured in windows;
  `estimation.fake` is what that needs (the fake process group, the byte count, routing's values).
- `estimation.layout`: those windows laid out along the model, the layout and the pipeline schedule:
  every pipeline rank's peak, and what the CUDA caching allocator reserves for it.
- `estimation.planner`: layouts for a GPU count, ranked by a stated throughput model, estimated in that
  order until enough fit.

`estimation/estimate.py` and `estimation/plan.py` are the command-line entry points; `estimation/fits.py`
is train.py's memory check (registered as a `titanlike.preflight` entry point: the library never
imports this package).
"""
