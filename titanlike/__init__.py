"""titanlike: a PyTorch-native LLM trainer.

    model = titanlike.load_model("outputs/checkpoint/step-1000")   # or a Hugging Face folder
    logits = model(tokens)                                            # (batch, seq) -> (batch, seq, vocab)
"""


def load_model(path, device="cpu", *, dtype=None):
    """An unsharded model from a titanlike DCP checkpoint or a Hugging Face folder (see
    titanlike.checkpoint.hf.load_model). Imported lazily: `import titanlike` stays cheap."""
    from titanlike.checkpoint.hf import load_model as _load_model

    return _load_model(path, device, dtype=dtype)


__all__ = ["load_model"]
