"""Where a checkpoint's files are: a local directory, or a repository on the Hugging Face Hub.

A name that is no existing directory, and that huggingface_hub's own validator takes for a repository
id ("org/name" or "name", dots allowed), is downloaded with `snapshot_download` into huggingface_hub's
cache, the files the loader reads and no others. `revision=` and `token=` mean what they mean to
transformers' `from_pretrained`; `HF_ENDPOINT`, `HF_HUB_CACHE`, `HF_HUB_OFFLINE` and `HF_TOKEN` act as
they do there. What the hub answers (no such repository, a gated one, no such revision, no network)
becomes one line that names the id.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Literal

from .._errors import LoadError


@dataclasses.dataclass(frozen=True)
class _Layout:
    marker: str  # the file a directory of this kind holds
    what: str  # what the directory holds, as an error names it
    hint: str  # how to make one, where an error asks for one
    files: tuple[str, ...]  # what to download besides the weights (fnmatch patterns; `*` crosses folders)
    weights: tuple[str, ...]  # the weights, where no index names them
    index: str | None = None  # the file that names the weight files, where there is one
    skipped: tuple[str, ...] = ()


_LAYOUTS = {
    # A transformers checkpoint: config, tokenizer, processors, chat template, sentence-transformers'
    # pooling; the safetensors that model.safetensors.index.json names where there is one.
    "model": _Layout(
        "config.json",
        "checkpoint",
        "",
        ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja", "1_Pooling/*"),
        ("*.safetensors",),
        index="model.safetensors.index.json",
    ),
    # A diffusers pipeline: model_index.json and each component's folder; weight variants
    # (`name.fp16.safetensors`) are skipped, as from_pretrained without `variant=` skips them.
    "pipeline": _Layout(
        "model_index.json",
        "diffusers pipeline",
        " (save it with pipe.save_pretrained)",
        ("model_index.json", "*/*.json", "*/*.txt", "*/*.model", "*/*.jinja"),
        ("*/*.safetensors",),
        skipped=("*.*.safetensors",),
    ),
}

Kind = Literal["model", "pipeline"]


def resolve_checkpoint(
    path_or_hub_id: str | os.PathLike,
    *,
    revision: str | None = None,
    token: str | bool | None = None,
    kind: Kind = "model",
    caller: str = "hfjax.load",
) -> pathlib.Path:
    """A local directory holding a checkpoint (kind="model": config.json) or a diffusers pipeline
    (kind="pipeline": model_index.json), for a path or a hub id.

    Args:
      path_or_hub_id: an existing directory, or a hub id such as "Qwen/Qwen3-0.6B" (downloaded into
        huggingface_hub's cache, or found there offline).
      revision: for a hub id, the branch, tag or commit hash (default: the repository's main branch).
      token: for a hub id, the token to send (a string; True: the stored one, as `hf auth login`
        saves it; None: the stored one or HF_TOKEN where there is one).
      kind: "model" or "pipeline".
      caller: the public function named in errors.

    Returns:
      The directory (for a hub id, the snapshot's folder in the cache).

    Example:
      >>> resolve_checkpoint("meta-llama/Llama-3.1-8B", token="hf_...")
      PosixPath('~/.cache/huggingface/hub/models--meta-llama--Llama-3.1-8B/snapshots/...')
    """
    layout = _LAYOUTS[kind]
    path = pathlib.Path(path_or_hub_id).expanduser()
    if path.is_dir():
        if not (path / layout.marker).is_file():
            raise LoadError(
                f"{caller}: {str(path)!r} is a directory but holds no {layout.marker}; "
                f"pass a {layout.what} directory{layout.hint}"
            )
        return path
    text = os.fspath(path_or_hub_id)
    if path.exists() or not _is_hub_id(text):
        raise LoadError(
            f"{caller}: no checkpoint directory at {text!r}; pass an existing local path or a hub id like 'org/name'"
        )
    folder = _download(text, layout, revision, token, caller)
    if not (folder / layout.marker).is_file():
        raise LoadError(
            f"{caller}: the Hugging Face Hub repository {text!r} holds no {layout.marker}; "
            f"pass the id of a {layout.what} repository"
        )
    return folder


def _is_hub_id(text: str) -> bool:
    # What only a local path looks like (absolute, relative, home, nested folders) is never a hub id.
    if text.startswith(("/", "./", "../", "~")) or text.count("/") > 1 or "\\" in text:
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _download(repo_id: str, layout: _Layout, revision: str | None, token, caller: str) -> pathlib.Path:
    """The repository's snapshot folder: first its small files, then the weights its index names (or
    the layout's weight patterns), at the commit the first download found."""
    folder = _snapshot(repo_id, layout, layout.files, revision, revision, token, caller)
    index = folder / layout.index if layout.index else None
    if index is not None and index.is_file():
        weights = tuple(sorted(set(json.loads(index.read_text())["weight_map"].values())))
    else:
        weights = layout.weights
    return _snapshot(repo_id, layout, weights, folder.name, revision, token, caller)


def _snapshot(repo_id: str, layout: _Layout, allow, commit: str | None, revision, token, caller) -> pathlib.Path:
    # `commit`: the revision to download (the commit hash, once known); `revision`: the one asked for.
    from huggingface_hub import snapshot_download

    try:
        return pathlib.Path(
            snapshot_download(
                repo_id, revision=commit, token=token, allow_patterns=list(allow), ignore_patterns=list(layout.skipped)
            )
        )
    except Exception as error:
        message = _hub_error(error, repo_id, revision, layout)
        if message is None:
            raise
        raise LoadError(f"{caller}: {message}") from None


def _hub_error(error: Exception, repo_id: str, revision: str | None, layout: _Layout) -> str | None:
    """What the hub's answer (or its silence) means for `repo_id`, as the tail of one line; None for
    an error that is not the hub's."""
    from huggingface_hub import constants
    from huggingface_hub import errors as hub

    at = f" at revision {revision!r}" if revision else ""
    if isinstance(error, hub.GatedRepoError):
        return (
            f"{repo_id!r} is a gated repository and the Hugging Face Hub refused access ({_said(error)}); "
            "accept its conditions on its page, then log in with `hf auth login` or pass token="
        )
    if isinstance(error, hub.RepositoryNotFoundError):
        return (
            f"{repo_id!r} is no local directory, and the Hugging Face Hub has no repository by that name "
            f"({_said(error)}); check the id, or for a private repository log in with `hf auth login` or pass token="
        )
    if isinstance(error, hub.RevisionNotFoundError):
        return (
            f"the Hugging Face Hub repository {repo_id!r} has no revision {revision!r} ({_said(error)}); "
            "pass a branch, tag or commit hash that exists"
        )
    if isinstance(error, hub.EntryNotFoundError) and isinstance(error, hub.HfHubHTTPError):
        filename = str(error.response.url).rsplit("/resolve/", 1)[-1].split("/", 1)[-1]
        return (
            f"the Hugging Face Hub lists {filename!r} in {repo_id!r}{at} but does not serve it ({_said(error)}); "
            "try again later, or pass the revision= of another commit"
        )
    if isinstance(error, hub.LocalEntryNotFoundError):
        if _offline(error) or constants.HF_HUB_OFFLINE:
            return (
                f"{repo_id!r}{at} is not in the local Hugging Face cache and offline mode is on (HF_HUB_OFFLINE=1), "
                f"so the Hugging Face Hub could not be reached; download it once online, or pass a local path to a "
                f"{layout.what} directory"
            )
        cause = error.__cause__
        reason = f"{type(cause).__name__}: {_one_line(str(cause))}" if cause else type(error).__name__
        return (
            f"{repo_id!r} is not a local directory and the Hugging Face Hub could not be reached ({reason}); "
            f"check the network (and HF_ENDPOINT), or pass a local path to a {layout.what} directory"
        )
    if isinstance(error, hub.HfHubHTTPError):
        if error.response.status_code == 401:
            return (
                f"the Hugging Face Hub refused the token for {repo_id!r} ({_said(error)}); "
                "log in again with `hf auth login` or pass a valid token="
            )
        return (
            f"downloading {repo_id!r}{at} from the Hugging Face Hub failed ({_said(error)}); "
            "run it again to resume the download"
        )
    if isinstance(error, OSError):
        return (
            f"downloading {repo_id!r}{at} from the Hugging Face Hub failed ({type(error).__name__}: "
            f"{_one_line(str(error))}); check the network and the disk space of the cache, then run it again"
        )
    return None


def _said(error) -> str:
    # "401 GatedRepo: Access to model org/name is restricted ...": the status, the hub's error code and message.
    response = error.response
    code = response.headers.get("X-Error-Code")
    head = f"{response.status_code} {code}" if code else f"{response.status_code} {response.reason_phrase}"
    message = error.server_message or response.headers.get("X-Error-Message")
    return f"{head}: {_one_line(message)}" if message else head


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _offline(error: BaseException | None) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled

    while error is not None:
        if isinstance(error, OfflineModeIsEnabled):
            return True
        error = error.__cause__ or error.__context__
    return False
