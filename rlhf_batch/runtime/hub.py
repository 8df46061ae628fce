"""Hub ids (``org/name`` or ``org/name@revision``, when no such local directory exists): resolved
once, when the config is loaded, to the snapshot directory in the Hugging Face cache
(`huggingface_hub.snapshot_download`, honouring ``HF_HOME`` / ``HF_HUB_CACHE`` and
``HF_HUB_OFFLINE``); from then on a local directory like any other."""

from __future__ import annotations

import os
import re
from pathlib import Path

from rlhf_batch.errors import ModelError

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")  # org/name[@revision]


HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # no other weights


def is_hub_id(spec: str) -> bool:
    """`org/name[@revision]` that is not an existing path."""
    return bool(HUB_ID.match(spec)) and not spec.startswith(".") and not Path(spec).expanduser().exists()


def hub_cache() -> Path:
    """The Hugging Face hub cache, read from the environment now (HF_HUB_CACHE, HF_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_hub_model(spec: str, what: str) -> str:
    """The snapshot directory of hub id `spec` (`org/name[@revision]`) in the Hugging Face cache,
    downloaded first unless HF_HUB_OFFLINE is set; ModelError in one line otherwise."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    repo, _, revision = spec.partition("@")
    cache, offline = hub_cache(), hub_offline()
    try:
        path: str = snapshot_download(  # type: ignore[assignment]
            repo,
            revision=revision or None,
            cache_dir=cache,
            local_files_only=offline,
            allow_patterns=HUB_FILES,
        )
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        rev = f" --revision {revision}" if revision else ""
        why = (
            "HF_HUB_OFFLINE is set; fetch it with `hf download {0}` (same HF_HOME) or unset HF_HUB_OFFLINE"
            if offline
            else "the Hub cannot be reached; fetch it with `hf download {0}` where it can (same HF_HOME)"
        ).format(f"{repo}{rev}")
        raise ModelError(
            f"{what}: {spec!r} is not a local directory and not in the Hugging Face cache ({cache}), and {why}"
        ) from None
    except Exception as e:  # noqa: BLE001 - network, authentication, unknown repository
        raise ModelError(
            f"{what}: cannot fetch {spec!r} from the Hugging Face Hub ({str(e).splitlines()[0]})"
        ) from None
    return path


def hub_revision(path: str | Path) -> dict[str, str] | None:
    """{"id", "revision"} when `path` is a snapshot in a Hugging Face cache
    (.../models--org--name/snapshots/<commit>), else None."""
    parts = Path(path).resolve().parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return {"id": parts[-3][len("models--") :].replace("--", "/"), "revision": parts[-1]}
    return None


HUB_DATASET = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?(:[\w.-]+)?$")  # org/name[@rev][:split]


def is_hub_dataset(spec: str, base: Path | None = None) -> bool:
    """`org/name[@revision][:split]` that is no local path (relative to `base`, else the cwd)."""
    root = base or Path.cwd()
    org = spec.partition("/")[0]
    return bool(HUB_DATASET.match(spec)) and not (root / spec).exists() and not (root / org).is_dir()
