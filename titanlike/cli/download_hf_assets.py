"""Download a model's files from the Hugging Face Hub: torchtitan's scripts/download_hf_assets.py, same
flags, with huggingface_hub.

    titanlike-download-hf-assets --repo_id meta-llama/Llama-3.1-8B --assets tokenizer --hf_token ...
    titanlike-download-hf-assets --repo_id Qwen/Qwen3-0.6B --all --local_dir assets/hf/

writes into LOCAL_DIR/<model name> (torchtitan's layout: assets/hf/Llama-3.1-8B), then prints the
train.py flags that use the files: `--model.hf_assets_path` for the tokenizer (and, with the weights,
`--checkpoint.initial_load_in_hf`). Asset types: tokenizer (tokenizer.json, tokenizer_config.json,
tokenizer.model, vocab.txt, vocab.json, merges.txt, special_tokens_map.json), safetensors, index,
config; --additional_patterns adds file patterns, --all takes every file. This is the one titanlike
program that uses the network; training itself never downloads. Without network access it says so in
one sentence (exit 1): download on a machine that has it and copy the folder.
"""

from __future__ import annotations

import argparse
import errno
import os
import socket
import sys
from fnmatch import fnmatch

ASSET_PATTERNS = {
    "tokenizer": ["tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.txt", "vocab.json",
                  "merges.txt", "special_tokens_map.json"],
    "safetensors": ["*.safetensors", "*model.safetensors.index.json"],
    "index": ["*model.safetensors.index.json"],
    "config": ["config.json", "generation_config.json"],
}


class HubError(RuntimeError):
    """The Hub could not be reached or refused: one sentence."""


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    doc = __doc__.split("\n\n")
    p = argparse.ArgumentParser(prog=prog, description=doc[0], epilog="\n\n".join(doc[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repo_id", required=True, help="repository to download from, organization/model "
                                                   "(e.g. meta-llama/Llama-3.1-8B)")
    p.add_argument("--hf_token", default=None, help="Hugging Face token, for private or gated repositories "
                                                   "(default: huggingface_hub's, HF_TOKEN or the login)")
    p.add_argument("--local_dir", default="assets/hf/", help="folder the model's folder goes in (default assets/hf/)")
    p.add_argument("--assets", nargs="+", default=[], choices=sorted(ASSET_PATTERNS), metavar="ASSET",
                   help=f"asset types to download: {', '.join(ASSET_PATTERNS)}")
    p.add_argument("--additional_patterns", nargs="+", default=[],
                   help="more file patterns to download (e.g. '*.safetensors' README.md)")
    p.add_argument("--all", action="store_true", help="download every file of the repository")
    return p


def selected(files: list[str], assets: list[str], patterns: list[str]) -> list[str]:
    """The repository's files that the asset types and patterns name (torchtitan's matching: a file's
    base name equals a pattern, or matches it as a wildcard; here both ignore case)."""
    wanted = [p.lower() for a in assets for p in ASSET_PATTERNS[a]] + [p.lower() for p in patterns]
    return [f for f in files if any(os.path.basename(f).lower() == p or
                                    (("*" in p or "?" in p) and fnmatch(os.path.basename(f).lower(), p))
                                    for p in wanted)]


def _hub_call(what: str, fn, *args, **kwargs):
    """fn(*args, **kwargs); HubError (one sentence) when the Hub is unreachable or refuses."""
    from huggingface_hub import errors

    try:
        return fn(*args, **kwargs)
    except errors.OfflineModeIsEnabled:
        raise HubError(f"{what}: huggingface_hub is in offline mode (HF_HUB_OFFLINE is set), so nothing can be "
                       "downloaded; download on a machine with network access and copy the folder") from None
    except errors.GatedRepoError:
        raise HubError(f"{what}: the repository is gated; accept its license on the Hub and pass --hf_token") from None
    except errors.RepositoryNotFoundError:
        raise HubError(f"{what}: no such repository, or it is private (pass --hf_token)") from None
    except errors.HfHubHTTPError as e:
        status = getattr(e.response, "status_code", None)
        if status in (401, 403):
            raise HubError(f"{what}: the Hub refused the request ({status}); pass a valid --hf_token") from None
        raise HubError(f"{what}: the Hub answered {status}: {' '.join(str(e).split())[:200]}") from None
    except Exception as e:  # connection refused, DNS, timeouts: httpx's or requests' errors, OSError
        if _is_connection_error(e):
            raise HubError(f"{what}: cannot reach the Hugging Face Hub ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:120]}); this machine seems offline: download on a machine with "
                           "network access and copy the folder") from None
        raise


# The transport errors of the HTTP clients huggingface_hub has used (requests, httpx, its httpx2 fork), by
# class name: the client is huggingface_hub's choice, so none is imported here to check against.
_TRANSPORT_ERRORS = {"ConnectError", "ConnectTimeout", "ConnectionError", "TimeoutException", "ReadTimeout",
                     "NetworkError", "TransportError", "ProxyError", "Timeout"}


_NET_ERRNOS = {errno.ENETUNREACH, errno.ENETDOWN, errno.EHOSTUNREACH, errno.ECONNREFUSED, errno.ECONNRESET,
               errno.ETIMEDOUT}


def _is_connection_error(e: BaseException) -> bool:
    """Whether e (or what caused it) is a network failure: a refused or unreachable connection, a DNS
    failure, a timeout."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if (isinstance(e, (ConnectionError, TimeoutError, socket.gaierror)) or getattr(e, "errno", None) in _NET_ERRNOS
                or {c.__name__ for c in type(e).__mro__} & _TRANSPORT_ERRORS):
            return True
        e = e.__cause__ or e.__context__
    return False


def download(repo_id: str, local_dir: str, assets: list[str], *, download_all: bool = False, hf_token: str | None = None,
             additional_patterns: list[str] = (), log=print) -> tuple[str, list[str]]:
    """Download into local_dir/<model name>; returns (that folder, the files downloaded)."""
    try:
        from huggingface_hub import hf_hub_download, list_repo_files
    except ImportError:
        raise HubError("downloading needs the huggingface_hub package: pip install huggingface_hub") from None
    model_dir = os.path.join(local_dir, repo_id.split("/")[-1].strip())
    log(f"listing the files of {repo_id} on the Hugging Face Hub")
    files = _hub_call(f"listing {repo_id}", list_repo_files, repo_id=repo_id, token=hf_token)
    if not download_all:
        for asset in assets:
            if not selected(files, [asset], []):
                log(f"warning: no {asset} file in {repo_id}")
        files = selected(files, assets, additional_patterns)
        if not files:
            raise HubError(f"{repo_id} has no file of the asset types / patterns asked for")
    log(f"downloading {len(files)} file(s) of {repo_id} to {model_dir}")
    for name in files:
        _hub_call(f"downloading {name} of {repo_id}", hf_hub_download, repo_id=repo_id, filename=name,
                  local_dir=model_dir, token=hf_token)
        log(f"  {name}")
    return model_dir, files


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    if not (args.all or args.assets or args.additional_patterns):
        parser.error("at least one of --all, --assets or --additional_patterns must be given")
    if args.repo_id.count("/") != 1 or not all(args.repo_id.split("/")):
        parser.error(f"--repo_id {args.repo_id!r} is not organization/model-name")
    try:
        model_dir, files = download(args.repo_id, args.local_dir, args.assets, download_all=args.all,
                                    hf_token=args.hf_token, additional_patterns=args.additional_patterns)
    except HubError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    names = {os.path.basename(f) for f in files}
    flags = []
    if "tokenizer.json" in names:
        flags.append(f"--model.hf_assets_path {model_dir}")
    if any(n.endswith(".safetensors") for n in names) and "config.json" in names:
        flags.append(f"--checkpoint.initial_load_path {model_dir} --checkpoint.initial_load_in_hf")
    print(f"downloaded {len(files)} file(s) to {model_dir}" + (f"; train with {' '.join(flags)}" if flags else ""))
    return 0


def console_main() -> None:
    sys.exit(main(prog="titanlike-download-hf-assets"))
