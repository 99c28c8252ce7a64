"""Hugging Face Hub ids as checkpoint folders: ``load_model("GSAI-ML/LLaDA-8B-Instruct")`` reads the repository's
snapshot in huggingface_hub's cache (``$HF_HOME/hub``), downloading it there first where the network allows.

Only what tracelock reads is fetched: safetensors weights, JSON configs and the tokenizer's files (never the pickled
``.bin`` / ``.pt`` weights, and no remote code is run). ``HF_HUB_OFFLINE=1`` keeps it to the cache.
"""

from pathlib import Path

from tracelock.models.spec import CheckpointError

# what `load_model` and `load_tokenizer` read from a checkpoint folder
HUB_FILES = ["*.json", "*.safetensors", "*.txt", "*.jinja", "tokenizer.model"]


def _complete(folder: Path) -> bool:
    """A cached snapshot that holds a config and weights (an earlier, partial download may hold less)."""
    return (folder / "config.json").is_file() and any((folder / f).is_file() for f in
                                                      ("model.safetensors", "model.safetensors.index.json"))


def hub_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local snapshot folder of ``repo_id``: the cached one when complete, else a download (network allowing)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    cache = constants.HF_HUB_CACHE
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES, local_files_only=True))
        if _complete(folder):
            return folder
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise CheckpointError(f"model {repo_id!r} is not a folder here and not in the Hugging Face cache ({cache}), "
                              "and HF_HUB_OFFLINE=1 forbids downloading it: download it where the network allows "
                              f"(`hf download {repo_id}`), or pass a checkpoint folder")
    try:
        folder = Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES))
    except RepositoryNotFoundError:
        raise CheckpointError(f"model {repo_id!r} is not a folder here nor a Hugging Face Hub repository you can "
                              "read: check the spelling (or log in with `hf auth login` for a gated one), or pass a "
                              "checkpoint folder") from None
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError) as err:
        raise CheckpointError(f"model {repo_id!r} is not a folder here and could not be downloaded from the Hugging "
                              f"Face Hub ({type(err).__name__}: {str(err).splitlines()[0]}); check the network, or "
                              f"download it elsewhere into {cache} and set HF_HUB_OFFLINE=1") from None
    if not _complete(folder):
        raise CheckpointError(f"the Hugging Face Hub repository {repo_id!r} holds no config.json and safetensors "
                              "weights (tracelock never unpickles .bin files); convert it to safetensors")
    return folder
