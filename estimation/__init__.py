"""Memory estimation and layout planning for titanlike jobs, without GPUs.

`probe` runs the job's own training step on fake tensors (`fake`: the fake process group, the byte
count, routing's values), one block of each kind; `layout` lays that out along the model, the layout
and the pipeline schedule; `options` plans the job the probe runs. `estimate.py` (the report) and
`plan.py` (the layout planner) are the commands; `fits.py` is train.py's memory check, registered as
a `titanlike.preflight` entry point (the library never imports this package).
"""
