"""Command-line entry points, installed as console scripts by `pip install` (pyproject.toml's
[project.scripts]), so that training, conversion and sampling need no checkout:

    titanlike-train            train.py (also: python -m titanlike.train)
    titanlike-convert          to-hf | from-hf: scripts/convert_dcp_to_hf.py, convert_hf_to_dcp.py
    titanlike-generate         scripts/generate.py
    titanlike-download-hf-assets  scripts/download_hf_assets.py (torchtitan's flags)
    titanlike-estimate, titanlike-plan  estimation/estimate.py, estimation/plan.py (the estimator is a
                               package installed beside the library, which never imports it)

The scripts of a checkout are thin wrappers of these modules.
"""
