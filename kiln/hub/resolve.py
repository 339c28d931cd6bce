"""Model names to local directories: a path as it is, or a Hub repo id (`org/name[@revision]`) through the HF cache.

Repo ids go through huggingface_hub (an optional extra): the cached snapshot when downloads are
off (HF_HUB_OFFLINE=1), else a download of the files kiln reads into the same cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kiln.errors import KilnError

# org/name as the Hub spells them (letters, digits, - _ .), then an optional @revision (branch, tag, commit, refs/pr/N)
_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[\w./-]+))?")

# What kiln reads from a model repo: configs, safetensors (sharded or not, adapters too), tokenizer files.
_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja"]
_BIN_FILES = ["pytorch_model*.bin"]  # only when a repo has no safetensors


def parse_repo_id(name: str) -> tuple[str, str | None] | None:
    """("org/name", revision or None) if `name` reads as a Hub repo id, else None."""
    m = _REPO_ID.fullmatch(name)
    return (m["repo"], m["revision"]) if m else None


def _offline() -> bool:
    from huggingface_hub import constants

    # the constant is read when huggingface_hub is imported; the variables may be set later in this process
    later = (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").upper()
    return bool(constants.HF_HUB_OFFLINE) or later in ("1", "ON", "YES", "TRUE")


def resolve_model_dir(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local path as given; an `org/name[@revision]` that is not a local path, as its HF cache snapshot.

    `cache_dir` overrides the cache (default: HF_HUB_CACHE, else HF_HOME/hub). A path that is neither
    (e.g. a missing local directory) is returned as it is, for the reader to name as missing.
    """
    path = Path(name_or_path)
    parsed = None if path.exists() else parse_repo_id(str(name_or_path))
    if parsed is None:
        return path
    repo, revision = parsed
    shown = f"{repo}@{revision}" if revision else repo
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import (
            GatedRepoError,
            HfHubHTTPError,
            HFValidationError,
            LocalEntryNotFoundError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )
    except ImportError:
        raise KilnError(f"{shown}: no such directory; to load it as a Hub repo id, install huggingface_hub "
                        "(pip install 'kiln[hub]')") from None
    offline = _offline()
    cache = Path(cache_dir or constants.HF_HUB_CACHE)
    try:
        snapshot = Path(snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=offline,
                                          allow_patterns=_FILES))
        if not offline and not any(snapshot.glob("*.safetensors")):
            snapshot = Path(snapshot_download(repo, revision=revision, cache_dir=cache, allow_patterns=_BIN_FILES))
    except LocalEntryNotFoundError as e:
        how = "downloads are off (HF_HUB_OFFLINE=1)" if offline else "the Hub could not be reached"
        if type(e).__name__ == "IncompleteSnapshotError":  # huggingface_hub >= 1.x knows a partial snapshot
            raise KilnError(f"{shown}: only part of it is in the HF cache ({cache}) and {how}: {e}") from None
        raise KilnError(f"{shown} is not a local directory and not in the HF cache ({cache}; HF_HOME="
                        f"{constants.HF_HOME}), and {how}; download it where you are online "
                        f"(hf download {repo}{f' --revision {revision}' if revision else ''}), point HF_HUB_CACHE "
                        "at a cache that holds it, or pass a local directory") from None
    except HFValidationError as e:
        raise KilnError(f"{shown}: no such local directory, and not a valid Hub repo id ({e})") from None
    except GatedRepoError:
        raise KilnError(f"{shown}: a gated repo; accept its terms on the Hub and log in (hf auth login)") from None
    except RevisionNotFoundError:
        raise KilnError(f"{shown}: the Hub repo {repo} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise KilnError(f"{shown}: no such Hub repo (or a private one: log in with hf auth login), and no such "
                        "local directory") from None
    except (HfHubHTTPError, OSError) as e:
        raise KilnError(f"{shown}: could not fetch it from the Hub ({type(e).__name__}: {e})") from None
    return snapshot
