"""`--force` without losing finished work: the new output is written beside the old one and
swapped in only once it is complete.

    iter=K/.<folder>.new/           the forced run's output while it is written (parts, manifest;
                                    train also its policy, in .train.new/policy)
    iter=K/.<folder>.old/           the replaced output, for the moment of the swap

The commit point is the staged folder's `_manifest.json`: before it, the old folder (and the
old policy) is untouched, whatever fails or is killed; a forced re-run with the same identity
resumes the staged parts. After it, the swap is finished by whoever comes next (`recover`, run
by every command that writes a run, under the run lock). On an object store (no rename) a
forced stage removes its folder first, as before: the staged policy replaces iter=K/policy,
the old folder is renamed away, the staged one renamed into place, the old one deleted. Each
step is a rename or the deletion of what is already replaced, so a kill between any two leaves a
state that `recover` finishes the same way.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.store import fs, layout

# what a staged folder holds that lives beside the folder once committed (train: its policy)
OUTSIDE = {layout.TRAIN: (layout.POLICY_DIR,)}


def staged(final: Path) -> Path:
    """Where a forced run of the folder `final` writes."""
    return final.with_name(f".{final.name}.new")


def retired(final: Path) -> Path:
    return final.with_name(f".{final.name}.old")


def committed(stage_dir: Path) -> bool:
    return (stage_dir / layout.MANIFEST).is_file()


def commit(final: Path) -> None:
    """Swap the complete staged output of `final` into place (idempotent, resumable)."""
    from rlhf_batch.store.atomic import fsync_dir

    new, old = staged(final), retired(final)
    if not committed(new):
        return
    fault_point(f"{final.name}:commit")
    if same_output(final):
        shutil.rmtree(new)
        return
    for name in OUTSIDE.get(final.name, ()):
        src, dst = new / name, final.parent / name
        if src.exists():
            _replace(src, dst)
            (final.parent / layout.POLICY_REMOVED).unlink(missing_ok=True)  # a new policy is here
            fault_point(f"{final.name}:commit:{name}")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        fault_point(f"{final.name}:commit:retired")
    os.rename(new, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def same_output(final: Path) -> bool:
    """Whether the staged output of `final` is the one already there: both complete with the
    same identity and the same parts, byte for byte (a forced re-run that changed nothing; the
    old folder is then kept, so the manifest later stages fingerprinted stays as it was)."""
    import filecmp

    from rlhf_batch.store.manifests import manifest

    old, new = manifest(final) if final.is_dir() else None, manifest(staged(final))
    if old is None or new is None or old.get("key") != new.get("key") or not new.get("parts"):
        return False
    names = [p["file"] for p in new["parts"]]
    if [p["file"] for p in old.get("parts", [])] != names:
        return False
    return all(filecmp.cmp(final / n, staged(final) / n, shallow=False) for n in names)


def _replace(src: Path, dst: Path) -> None:
    trash = dst.with_name(f".{dst.name}.old")
    shutil.rmtree(trash, ignore_errors=True)
    if dst.exists():
        os.rename(dst, trash)
    os.rename(src, dst)
    shutil.rmtree(trash, ignore_errors=True)


def drop_if_empty(new: Path) -> None:
    """Remove a staging folder that holds no part (nothing a re-run could resume)."""
    if new.is_dir() and not layout.list_parts(new) and not any(new.glob(f"{layout.CHECKPOINT_DIR}/*")):
        shutil.rmtree(new, ignore_errors=True)


def recover(run_dir: str | Path) -> None:
    """Finish every swap a kill interrupted in the run directory: a committed staged folder is
    swapped in; an old folder whose replacement is in place is deleted, one whose replacement is
    not is put back."""
    if fs.scheme(run_dir) or fs.is_remote(run_dir):
        return
    root = Path(run_dir)
    if not root.is_dir():
        return
    for it in root.glob("iter=*"):
        for parent in (it, *it.glob("topup=*")):
            for name in layout.FOLDERS:
                recover_folder(parent / name)


def recover_folder(final: Path) -> None:
    if fs.is_remote(final):  # no staging on an object store (no rename)
        return
    new, old = staged(final), retired(final)
    if committed(new):
        commit(final)
    elif old.exists():
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(old, final)
