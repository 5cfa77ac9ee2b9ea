"""scripts/download_hf_assets.py (titanlike-download-hf-assets): torchtitan's flags, which files each asset
type selects, and one clear sentence when the Hub cannot be reached. Nothing here touches the network:
DNS and connections are refused in-process (the Hub unreachable, as on a machine without network), or
huggingface_hub's listing and download functions are stand-ins."""

from __future__ import annotations

import socket
import time

import pytest

from titanlike.cli import download_hf_assets as dl

FILES = ["config.json", "generation_config.json", "model-00001-of-00002.safetensors",
         "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json", "original/tokenizer.model", "README.md", "LICENSE"]


@pytest.fixture
def no_network(monkeypatch):
    """Every DNS lookup and connection fails at once, as on a machine without network; huggingface_hub's
    retries do not wait."""
    def unreachable(*args, **kwargs):
        raise OSError(101, "Network is unreachable (test)")

    monkeypatch.setattr(socket, "getaddrinfo", unreachable)
    monkeypatch.setattr(socket.socket, "connect", unreachable)
    monkeypatch.setattr(time, "sleep", lambda seconds: None)


@pytest.fixture
def hub(monkeypatch):
    """A stand-in Hub holding FILES; records what is downloaded where."""
    import huggingface_hub

    got = []
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, token=None: list(FILES))

    def download(repo_id, filename, local_dir, token=None):
        got.append((filename, local_dir))
        return f"{local_dir}/{filename}"

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return got


@pytest.mark.parametrize("argv, fragment", [
    (["--assets", "tokenizer"], "the following arguments are required: --repo_id"),
    (["--repo_id", "meta-llama/Llama-3.1-8B"], "at least one of --all, --assets or --additional_patterns"),
    (["--repo_id", "meta-llama/Llama-3.1-8B", "--assets", "weights"], "invalid choice: 'weights'"),
    (["--repo_id", "Llama-3.1-8B", "--assets", "tokenizer"], "is not organization/model-name"),
])
def test_flag_errors(argv, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        dl.main(argv)
    assert exit_.value.code == 2 and fragment in capsys.readouterr().err


def test_offline_is_one_sentence(no_network, tmp_path, capsys):
    rc = dl.main(["--repo_id", "meta-llama/Llama-3.1-8B", "--assets", "tokenizer", "--local_dir", str(tmp_path)])
    err = capsys.readouterr().err
    line = [x for x in err.splitlines() if x.startswith("error:")]
    assert rc == 1 and len(line) == 1, err
    assert "cannot reach the Hugging Face Hub" in line[0] and "seems offline" in line[0]
    assert "Traceback" not in err and list(tmp_path.iterdir()) == []


def test_offline_mode_is_one_sentence(monkeypatch, tmp_path, capsys):
    import huggingface_hub
    from huggingface_hub import errors

    def offline(**kwargs):
        raise errors.OfflineModeIsEnabled("offline")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", offline)
    assert dl.main(["--repo_id", "org/model", "--all", "--local_dir", str(tmp_path)]) == 1
    assert "huggingface_hub is in offline mode (HF_HUB_OFFLINE is set)" in capsys.readouterr().err


def test_tokenizer_assets_go_to_the_models_folder(hub, tmp_path, capsys):
    assert dl.main(["--repo_id", "meta-llama/Llama-3.1-8B", "--assets", "tokenizer", "--local_dir", str(tmp_path)]) == 0
    folder = str(tmp_path / "Llama-3.1-8B")  # torchtitan's layout: LOCAL_DIR/<model name>
    assert sorted(hub) == sorted((f, folder) for f in ["tokenizer.json", "tokenizer_config.json",
                                                       "special_tokens_map.json", "original/tokenizer.model"])
    assert f"train with --model.hf_assets_path {folder}" in capsys.readouterr().out


def test_all_and_weights(hub, tmp_path, capsys):
    assert dl.main(["--repo_id", "org/model", "--all", "--local_dir", str(tmp_path)]) == 0
    assert sorted(f for f, _ in hub) == sorted(FILES)
    assert f"--checkpoint.initial_load_path {tmp_path / 'model'} --checkpoint.initial_load_in_hf" in capsys.readouterr().out
    hub.clear()
    assert dl.main(["--repo_id", "org/model", "--assets", "safetensors", "config", "--additional_patterns", "README.md",
                    "--local_dir", str(tmp_path)]) == 0
    assert sorted(f for f, _ in hub) == sorted(
        ["config.json", "generation_config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
         "model.safetensors.index.json", "README.md"])
