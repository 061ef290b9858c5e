"""``-hf USER/MODEL[:QUANT]`` / ``--hf-file FILE``: a GGUF from Hugging Face, as llama.cpp's
tools fetch one, through ``huggingface_hub`` into its standard cache (``HF_HOME``,
``HF_ENDPOINT`` and ``HF_TOKEN`` apply; a file already cached is not fetched again).

    path = download("unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M")     # the cached file's path

QUANT picks the repository's .gguf whose name carries it (any case); without one, Q4_K_M
when the repository has it, else its first .gguf (llama.cpp's rule). A model split in parts
(``-00001-of-00003.gguf``) is fetched whole and the first part returned, as llama.cpp loads it.
Without a network, a file in the cache still loads; otherwise one line says how to fetch it by
hand.
"""
from __future__ import annotations

import argparse
import os
import re

from runtime.errors import UserError

DEFAULT_QUANT = "Q4_K_M"
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")


def resolve_model(args: argparse.Namespace) -> None:
    """Fill ``args.model`` from ``-hf`` / ``--hf-file`` (downloading), or check that ``-m``
    was given where the command needs a model. UserError (one line) otherwise."""
    repo, file = getattr(args, "hf_repo", None), getattr(args, "hf_file", None)
    if file and not repo:
        raise UserError("--hf-file: give the repository too (-hf USER/MODEL --hf-file FILE)")
    if repo:
        if args.model:
            raise UserError("give -m FILE or -hf REPO, not both")
        args.model = download(repo, file)
    elif not args.model and getattr(args, "model_required", True):
        raise UserError("-m FILE (a GGUF model) or -hf USER/MODEL[:QUANT] is required")


def download(spec: str, file: str | None = None) -> str:
    """The local path of ``spec``'s GGUF (see the module docstring), fetched if not cached."""
    repo, _, quant = spec.partition(":")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise UserError(f"-hf {spec}: expected USER/MODEL[:QUANT] "
                        "(e.g. unsloth/Qwen3-30B-A3B-GGUF:Q4_K_M)")
    try:
        from huggingface_hub.utils import logging as hub_logging  # noqa: PLC0415
    except ImportError:
        raise UserError("-hf: needs the huggingface_hub package "
                        "(pip install huggingface_hub)") from None
    hub_logging.set_verbosity_error()      # its retry chatter: the one line below says it
    offline = _unreachable()
    try:
        name = file or _pick(repo, quant, _repo_files(repo, spec, offline))
    except UserError:
        if offline:                          # the cache lacks it: the network would not
            raise UserError(f"-hf {spec}: not in the cache and cannot reach {_endpoint()} "
                            f"({offline}); {_by_hand(repo, None)}") from None
        raise
    parts = [name]
    split = _SPLIT.search(name)
    if split:                           # every part, into one snapshot folder
        total = int(split.group(2))
        parts = [name[:split.start()] + f"-{i:05d}-of-{total:05d}.gguf"
                 for i in range(1, total + 1)]
    paths = [_fetch(repo, part, offline) for part in parts]
    return paths[parts.index(name)] if name in parts else paths[0]


def _endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")


def _by_hand(repo: str, file: str | None) -> str:
    where = f"{_endpoint()}/{repo}/resolve/main/{file}" if file else f"{_endpoint()}/{repo}"
    return (f"download it by hand ({where}, or `hf download {repo}"
            f"{' ' + file if file else ''}` where there is a network) and give -m FILE")


def _unreachable() -> str:
    """"" when the endpoint answers at all; else why not (so that an offline machine hears
    it at once, not after huggingface_hub's retries)."""
    import socket  # noqa: PLC0415
    from urllib.parse import urlsplit  # noqa: PLC0415

    from huggingface_hub import constants  # noqa: PLC0415

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY",
                                       "http_proxy", "ALL_PROXY", "all_proxy")):
        return ""                 # through a proxy: only huggingface_hub's own try can tell
    url = urlsplit(_endpoint())
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "", port), timeout=10).close()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return ""


def _repo_files(repo: str, spec: str, offline: str) -> list[str]:
    """The repository's files; offline, the ones already in the cache."""
    from huggingface_hub import HfApi  # noqa: PLC0415
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError  # noqa: PLC0415

    if offline:
        cached = _cached_files(repo)
        if cached:
            return cached
        raise UserError(f"-hf {spec}: cannot reach {_endpoint()} ({offline}); "
                        f"{_by_hand(repo, None)}")
    try:
        return list(HfApi(endpoint=_endpoint()).list_repo_files(repo))
    except RepositoryNotFoundError:
        raise UserError(f"-hf {spec}: no such repository at {_endpoint()} (or it needs a "
                        "token: HF_TOKEN)") from None
    except HfHubHTTPError as exc:
        why = _why(exc)
    except Exception as exc:  # noqa: BLE001 - offline: requests/httpx errors, HF_HUB_OFFLINE
        why = _why(exc)
    cached = _cached_files(repo)
    if cached:
        return cached
    raise UserError(f"-hf {spec}: cannot reach {_endpoint()} ({why}); {_by_hand(repo, None)}")


def _cached_files(repo: str) -> list[str]:
    from huggingface_hub import scan_cache_dir  # noqa: PLC0415

    try:
        info = scan_cache_dir()
    except Exception:  # noqa: BLE001 - no cache folder yet
        return []
    for cached in info.repos:
        if cached.repo_id == repo and cached.repo_type == "model":
            return sorted({os.path.relpath(f.file_path, rev.snapshot_path)
                           for rev in cached.revisions for f in rev.files})
    return []


def _pick(repo: str, quant: str, files: list[str]) -> str:
    """The .gguf file QUANT names (llama.cpp's rule, see the module docstring)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf")
                   and "mmproj" not in os.path.basename(f).lower())
    ggufs = [f for f in ggufs if not _SPLIT.search(f) or _SPLIT.search(f).group(1) == "00001"]
    if not ggufs:
        raise UserError(f"-hf {repo}: the repository has no .gguf file")
    wanted = quant or DEFAULT_QUANT
    matches = [f for f in ggufs if _has_quant(f, wanted)]
    if matches:
        return matches[0]
    if not quant:
        return ggufs[0]
    quants = sorted({q for f in ggufs if (q := _quant_of(f))})
    raise UserError(f"-hf {repo}:{quant}: no .gguf file with {quant} in its name "
                    f"(here: {', '.join(quants) or ', '.join(ggufs)})")


def _has_quant(name: str, quant: str) -> bool:
    base = os.path.basename(name).lower()
    return re.search(rf"(^|[-_./]){re.escape(quant.lower())}([-_.]|$)", base) is not None


def _quant_of(name: str) -> str:
    match = re.search(r"[-_.]((?:UD-)?I?Q\d[\w]*|F16|BF16|F32)(?:-\d{5}-of-\d{5})?\.gguf$",
                      os.path.basename(name), re.IGNORECASE)
    return match.group(1) if match else ""


def _fetch(repo: str, file: str, offline: str) -> str:
    from huggingface_hub import hf_hub_download  # noqa: PLC0415
    from huggingface_hub.errors import (EntryNotFoundError,  # noqa: PLC0415
                                        LocalEntryNotFoundError, RepositoryNotFoundError)

    try:
        return hf_hub_download(repo, file, endpoint=_endpoint(), local_files_only=bool(offline))
    except LocalEntryNotFoundError as exc:          # offline and not cached
        why = offline or _why(exc)
        raise UserError(f"-hf {repo}: cannot fetch {file} from {_endpoint()} ({why}); "
                        f"{_by_hand(repo, file)}") from None
    except (EntryNotFoundError, RepositoryNotFoundError):
        raise UserError(f"-hf {repo}: no file {file} there") from None
    except Exception as exc:  # noqa: BLE001 - offline and not cached
        why = offline or _why(exc)
        raise UserError(f"-hf {repo}: cannot fetch {file} from {_endpoint()} ({why}); "
                        f"{_by_hand(repo, file)}") from None


def _why(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= 160 else text[:157] + "..."
