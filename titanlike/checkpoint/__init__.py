"""Distributed checkpointing (DCP) and Hugging Face interchange."""

from titanlike.checkpoint.hf import CheckpointError, export_dcp_to_hf, import_hf_to_dcp, load_model
from titanlike.checkpoint.manager import CheckpointManager, published_steps

__all__ = ["CheckpointError", "CheckpointManager", "export_dcp_to_hf", "import_hf_to_dcp", "load_model",
           "published_steps"]
