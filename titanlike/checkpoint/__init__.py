"""Distributed checkpointing (DCP) and Hugging Face interchange.

format.py: the DCP formats on disk; hf.py: Hugging Face folders, conversions and load_model;
states.py: what a checkpoint holds; saving.py and loading.py: writing and reading a job's checkpoints;
manager.py: CheckpointManager, the trainer's facade over them; hooks.py: LoadHook, what a converter or
an objective adds on load (this package imports neither).
"""

from titanlike.checkpoint.format import CheckpointError, published_steps
from titanlike.checkpoint.hf import export_dcp_to_hf, hf_folder_args, import_hf_to_dcp, load_model
from titanlike.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointError", "CheckpointManager", "export_dcp_to_hf", "hf_folder_args", "import_hf_to_dcp",
           "load_model", "published_steps"]
