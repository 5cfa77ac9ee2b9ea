"""Distributed checkpointing (DCP) and Hugging Face interchange.

format.py: the on-disk formats; manager.py: CheckpointManager (save / resume a job);
hf.py: conversions and load_model. manager.py and hf.py depend on format.py only.
"""

from titanlike.checkpoint.format import CheckpointError, published_steps
from titanlike.checkpoint.hf import export_dcp_to_hf, hf_folder_args, import_hf_to_dcp, load_model
from titanlike.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointError", "CheckpointManager", "export_dcp_to_hf", "hf_folder_args", "import_hf_to_dcp",
           "load_model", "published_steps"]
