"""Retention of policies: `keep_policies = N` keeps the policies of the last N trained iterations,
`keep_every = M` also those of iterations 0, M, 2M, ...; 0 keeps everything (the default).

A policy is removed only once train of a later iteration is complete (its policy is on disk
and its manifest written), so the policy the next generate or train starts from is never
removed. With `max_staleness = S`, generate of iteration K samples from iteration K-1-S's
policy; the config requires keep_policies = 0 or > S, so once train of `latest` is complete the
policies of latest - S .. latest, those every generate still to run samples from (K > latest),
are kept. Before removing iter=K/policy, the fingerprint the stages recorded for it (its path,
config.json and weight file sizes: models.model_fingerprint) is written to
iter=K/policy_removed.json, and stages that read the policy once take their input fingerprint
from there: a complete stage is still complete (`run` skips it), nothing is redone, and the
manifests, metrics and every table of that iteration stay (SQL sees them as before). Only a
stage that must load the removed weights again (`--force` on generate K + 1) fails, naming
the file. The removal itself is a rename to a hidden name and then a delete, so a kill leaves
either the whole policy or none (the hidden leftover is deleted by the next prune). On an
object store (no rename) the policy's objects are deleted in place after its record is
written; a kill midway leaves the rest to the next prune.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlhf_batch.store import fs, layout

if TYPE_CHECKING:
    from rlhf_batch.config import Config


def kept(it: int, latest: int, keep_policies: int, keep_every: int) -> bool:
    """Whether iteration `it`'s policy is kept once train of `latest` is complete."""
    if not keep_policies:
        return True
    return it > latest - keep_policies or bool(keep_every and it % keep_every == 0)


def prune(cfg: Config, latest: int) -> list[int]:
    """After train of `latest` is complete: remove the policies retention does not keep (of
    iterations whose next iteration's train is complete). Returns the iterations removed."""
    from rlhf_batch.store.manifests import manifest

    if not cfg.keep_policies:
        return []
    removed = []
    for it in range(latest):
        pol = layout.policy_dir(cfg.run_dir, it)
        for trash in layout.iter_dir(cfg.run_dir, it).glob(f"{layout.POLICY_TRASH}*"):
            fs.remove(trash)  # a removal killed half-way
        if kept(it, latest, cfg.keep_policies, cfg.keep_every) or not pol.is_dir():
            continue
        if manifest(layout.folder(cfg.run_dir, it + 1, layout.TRAIN)) is None:
            continue  # the next policy is not complete: this one may still be needed
        remove_policy(pol, {"keep_policies": cfg.keep_policies, "keep_every": cfg.keep_every})
        removed.append(it)
    return removed


def remove_policy(pol: Path, why: dict[str, Any]) -> None:
    from rlhf_batch.store.atomic import write_json_atomic
    from rlhf_batch.store.modeldir import model_fingerprint

    store, record_path = fs.store_of(pol), pol.parent / layout.POLICY_REMOVED
    if not record_path.is_file():  # else a removal killed midway on a store: its record stands
        record = {  # paths below the run dir as "{run_dir}/...": the run can be moved or copied
            "fingerprint": layout.portable(model_fingerprint(str(pol), "policy"), _root(pol)),
            "removed": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json_atomic(record_path, {**record, **why})
    trash = pol.with_name(f"{layout.POLICY_TRASH}{time.time_ns()}")
    store.remove(trash if store.rename(pol, trash) else pol)


def _root(pol: Path) -> Path:
    """The run directory of the policy dir `pol` (absolute; a UPath is absolute already)."""
    return pol.parent.parent.absolute()
