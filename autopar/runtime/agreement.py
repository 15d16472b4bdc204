"""Every rank runs the same plan on the same model, checked before any collective.

Ranks started with different plan files (one node given dp2, another tp2) build
different meshes and groups; their first collectives never match, and the job waits out
the whole process-group timeout before failing with an unrelated store or gloo error.
So ``parallelize`` first compares, through the rendezvous store that
``init_process_group`` already connected, what each rank is about to run: a hash of the
plan's executed part (configuration, stages, layer strategies, the model it was made
for) and the fingerprint of the model the rank was given. Every rank compares its own
with rank 0's and reports a difference; once all have, every rank raises the same
error naming the ranks that differ. Each rank makes a constant number of store calls,
so the check costs the same per rank at 16 or 16,384 ranks.
"""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from autopar.plan import Plan
from autopar.runtime.errors import PlanMismatchError

PREFIX = "autopar/agreement"
SHOWN_RANKS = 8
"""Ranks named in the error (the count says how many more differ)."""


def plan_digest(plan: Plan) -> str:
    """A short hash of what the runtime executes from ``plan``: its configuration,
    stages, layer strategies and the model fingerprint it was made for (not the
    predictions or the explanation, which do not change what runs)."""
    data = plan.to_dict()
    executed = {k: data[k] for k in ("config", "stages", "layer_strategies")}
    executed["model"] = plan.model.fingerprint
    return hashlib.sha1(json.dumps(executed, sort_keys=True).encode()).hexdigest()[:12]


def check_agreement(plan: Plan, model_fingerprint: str) -> None:
    """Raise :class:`PlanMismatchError` on every rank when some rank's plan or model
    differs from rank 0's. The wait for the slowest rank is bounded by the process
    group's timeout (the store's). Nothing to compare under the fake process group of a
    dry run (one real rank)."""
    if dist.get_backend() == "fake" or dist.get_world_size() == 1:
        return
    store = c10d._get_default_store()
    timeout_s = store.timeout.total_seconds()
    rank, world = dist.get_rank(), dist.get_world_size()
    call = store.add(f"{PREFIX}/calls/{rank}", 1)  # parallelize may run more than once per process
    key = f"{PREFIX}/{call}"
    mine = json.dumps({"plan": plan_digest(plan), "config": plan.config.short(), "model": model_fingerprint})
    if rank == 0:
        store.set(f"{key}/reference", mine)
    _wait(store, [f"{key}/reference"], timeout_s, "rank 0")
    reference = store.get(f"{key}/reference").decode()
    if mine != reference:
        store.append(f"{key}/differ", f"{rank}={mine}\n")
    if store.add(f"{key}/arrived", 1) == world:
        store.set(f"{key}/done", "1")
    _wait(store, [f"{key}/done"], timeout_s, "some rank")
    if not store.check([f"{key}/differ"]):
        return
    raise PlanMismatchError(_message(json.loads(reference), store.get(f"{key}/differ").decode()))


def _wait(store: dist.Store, keys: list[str], timeout_s: float, who: str) -> None:
    try:
        store.wait(keys)
    except (RuntimeError, dist.DistError) as exc:
        raise PlanMismatchError(
            f"{who} did not reach autopar.parallelize within {timeout_s:g} s ({type(exc).__name__}); "
            f"check that every node started the same script with the same plan, or raise the process group's "
            f"timeout (AUTOPAR_PG_TIMEOUT_S)."
        ) from None


def _message(reference: dict[str, str], differ: str) -> str:
    rows = sorted((int(r), json.loads(v)) for r, v in (line.split("=", 1) for line in differ.splitlines() if line))
    shown = "; ".join(f"rank {r}: {_describe(v, reference)}" for r, v in rows[:SHOWN_RANKS])
    more = f" (and {len(rows) - SHOWN_RANKS} more ranks)" if len(rows) > SHOWN_RANKS else ""
    return (
        f"the ranks do not run the same plan and model: rank 0 runs {reference['config']} (plan {reference['plan']}, "
        f"model {reference['model']}), but {shown}{more}. Start every node with the same plan file and model."
    )


def _describe(value: dict[str, str], reference: dict[str, str]) -> str:
    parts = []
    if value["plan"] != reference["plan"]:
        parts.append(f"plan {value['config']} ({value['plan']})")
    if value["model"] != reference["model"]:
        parts.append(f"model {value['model']}")
    return " and ".join(parts)
