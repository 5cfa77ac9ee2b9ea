"""titanlike: a PyTorch-native LLM trainer.

    model = titanlike.load_model("outputs/checkpoint/step-1000")   # or a Hugging Face folder
    logits = model(tokens)                                            # (batch, seq) -> (batch, seq, vocab)
"""


def load_model(path, device="cpu", *, dtype=None):
    """An unsharded model from a titanlike DCP checkpoint or a Hugging Face folder (see
    titanlike.checkpoint.hf.load_model). Imported lazily: `import titanlike` stays cheap."""
    from titanlike.checkpoint.hf import load_model as _load_model

    return _load_model(path, device, dtype=dtype)


def _register_config_sections() -> None:
    """Import what registers config sections and dataset kinds (titanlike/config/sections.py): the
    data loader, the objectives and every model family. The config loader runs this the first time it
    needs either list, so a section is read whichever module a program imported first."""
    import titanlike.data.loader  # noqa: F401
    import titanlike.models.lora  # noqa: F401
    import titanlike.models.mx  # noqa: F401
    import titanlike.objectives  # noqa: F401
    from titanlike.models.registry import model_names

    model_names()  # imports every family


def _install_config_discovery() -> None:
    # config/ is a leaf that cannot import its owners; the package root hands it the importer.
    from titanlike.config.sections import add_discovery

    add_discovery(_register_config_sections)


_install_config_discovery()

__all__ = ["load_model"]
