"""`--force` without losing finished work: the new output is written beside the old one and
swapped in only once it is complete.

    iter=K/.<folder>.new/           the forced run's output while it is written (parts, manifest;
                                    train also its policy, in .train.new/policy)
    iter=K/.<folder>.old/           the replaced output, for the moment of the swap

The commit point is the staged folder's `_manifest.json`: before it, the old folder (and the
old policy) is untouched, whatever fails or is killed; a forced re-run with the same identity
resumes the staged parts (`run` removes them: it never resumes a forced stage). After it, the
swap is finished by whoever comes next (`recover`, run by every command that writes a run,
under the run lock). Where the store renames folders (`Store.renames`: a local disk) the staged
policy replaces iter=K/policy, the old folder is renamed away, the staged one renamed into
place, the old one deleted. On an object store (no rename) the staged objects are copied over
the old ones server side: the policy first, then the old manifest is removed, the parts copied
(old parts the new output lacks deleted), the manifest copied last, the staged prefix deleted.
Each step is a rename, a copy of what is staged or the deletion of what is already replaced, so
a kill between any two (a fault point sits in every window) leaves a state that `recover`
finishes the same way. Meanwhile a reader that finds the folder without its manifest reads the
committed staged folder (`manifests.current`): the staged manifest is the one write that makes
the new output current, on every store.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_batch.runtime.faults import fault_point
from rlhf_batch.store import fs, layout

# what a staged folder holds that lives beside the folder once committed (train: its policy)
OUTSIDE = {layout.TRAIN: (layout.POLICY_DIR,)}


staged = layout.staged  # where a forced run of a folder writes


def retired(final: Path) -> Path:
    return final.with_name(f".{final.name}{layout.RETIRED}")


def committed(stage_dir: Path) -> bool:
    return (stage_dir / layout.MANIFEST).is_file()


def commit(final: Path) -> None:
    """Swap the complete staged output of `final` into place (idempotent, resumable)."""
    new = staged(final)
    if not committed(new):
        return
    fault_point(f"{final.name}:commit")
    if same_output(final):
        _drop(new)
        return
    if fs.store_of(final).renames:
        _commit_by_rename(final)
    else:
        _commit_by_copy(final)


def _commit_by_rename(final: Path) -> None:
    """Where folders rename at once (a local disk): the old folder is renamed away, the staged
    one renamed into place, the old one removed."""
    store = fs.store_of(final)
    new, old = staged(final), retired(final)
    for name in OUTSIDE.get(final.name, ()):
        src, dst = new / name, final.parent / name
        if src.exists():
            _replace(store, src, dst, f"{final.name}:commit:{name}")
            store.remove(final.parent / layout.POLICY_REMOVED)  # a new policy is here
            fault_point(f"{final.name}:commit:{name}")
    if final.exists():
        store.remove(old)
        store.rename(final, old)
        fault_point(f"{final.name}:commit:retired")
    store.rename(new, final)
    store.sync(final.parent)
    fault_point(f"{final.name}:commit:swapped")  # the new folder in place, the old one still there
    store.remove(old)


def _commit_by_copy(final: Path) -> None:
    """On an object store (no rename): the staged objects are copied over the old ones (server
    side), the manifest last. The old output stops being current when its manifest is removed,
    which happens only once the staged manifest exists; a kill after that is finished by the
    next command the same way (every step is a copy of what is staged or the removal of what it
    replaces)."""
    new = staged(final)
    fs.guard(final, commit=True)
    for name in OUTSIDE.get(final.name, ()):
        if (new / name).is_dir():
            fs.mirror(new / name, final.parent / name)
            fs.remove(final.parent / layout.POLICY_REMOVED)  # a new policy is here
            fault_point(f"{final.name}:commit:{name}")
    fs.remove(final / layout.MANIFEST)  # the old output is no longer current
    fault_point(f"{final.name}:commit:retired")
    fs.mirror(new, final, last=layout.MANIFEST)
    fault_point(f"{final.name}:commit:swapped")  # the new output current, the staged copy still there
    _drop(new)


def _drop(new: Path) -> None:
    """Remove a staged folder, its manifest first (a staged folder without its manifest is never
    swapped in, so a kill while it is removed cannot swap half a folder)."""
    fs.remove(new / layout.MANIFEST)
    fs.remove(new)


def same_output(final: Path) -> bool:
    """Whether the staged output of `final` is the one already there: both complete with the
    same identity and the same parts, byte for byte (a forced re-run that changed nothing; the
    old folder is then kept, so the manifest later stages fingerprinted stays as it was)."""
    from rlhf_batch.store.manifests import read_json

    # the folder's own manifest (not `manifests.manifest`, which falls back to the staged one)
    own = [read_json(d / layout.MANIFEST) if committed(d) else None for d in (final, staged(final))]
    old, new = own
    if old is None or new is None or old.get("key") != new.get("key") or not new.get("parts"):
        return False
    names = [p["file"] for p in new["parts"]]
    if [p["file"] for p in old.get("parts", [])] != names:
        return False
    store = fs.store_of(final)
    return all(store.same_bytes(final / n, staged(final) / n) for n in names)


def _replace(store: fs.Store, src: Path, dst: Path, fault: str) -> None:
    trash = dst.with_name(f".{dst.name}{layout.RETIRED}")
    store.remove(trash)
    if dst.exists():
        store.rename(dst, trash)
        fault_point(f"{fault}:retired")
    store.rename(src, dst)
    fault_point(f"{fault}:swapped")
    store.remove(trash)


def drop_if_empty(new: Path) -> None:
    """Remove a staging folder that holds no part (nothing a re-run could resume)."""
    if new.is_dir() and not layout.list_parts(new) and not any(new.glob(f"{layout.CHECKPOINT_DIR}/*")):
        _drop(new)


def recover(run_dir: str | Path, drop_uncommitted: bool = False) -> None:
    """Finish every swap a kill interrupted in the run directory: a committed staged folder is
    swapped in; an old folder whose replacement is in place is deleted, one whose replacement is
    not is put back. With `drop_uncommitted` (`run`), a staged folder that was never committed
    (a forced stage that failed or was killed) is removed too: `run` never resumes it."""
    root = fs.run_path(run_dir)
    if not root.is_dir():
        return
    for it in root.glob("iter=*"):
        _recover_below(it, drop_uncommitted)


def _recover_below(parent: Path, drop_uncommitted: bool) -> None:
    kids = {p.name: p for p in parent.iterdir()}  # one listing per folder on an object store
    for name in layout.FOLDERS:
        final = parent / name
        if staged(final).name in kids or retired(final).name in kids:
            recover_folder(final)
            if drop_uncommitted and staged(final).is_dir():
                _drop(staged(final))
    for kid, path in kids.items():
        if kid.startswith("topup="):
            _recover_below(path, drop_uncommitted)


def recover_folder(final: Path) -> None:
    """Finish the swap of `final` a kill interrupted: a committed staged folder is swapped in;
    a retired folder (stores that rename) is removed once its replacement is in place, else put
    back. A store that copies never retires a folder: its old output stops being current only
    once the staged manifest exists, and the copy is finished by `commit`."""
    new, old = staged(final), retired(final)
    if committed(new):
        commit(final)
    elif old.exists():
        store = fs.store_of(final)
        if final.exists():
            store.remove(old)
        else:
            store.rename(old, final)
