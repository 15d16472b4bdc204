"""Solving a pulp model with HiGHS (in process) or CBC, and checking that it is optimal.

HiGHS is preferred: it proves optimality where CBC stalls, and pulp's ``LpStatus`` says
"Optimal" for a time-limited CBC run that only found *a* solution, so the solution
status is checked too (shared/TORCH-CPU.md, section 9).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import pulp

from autopar.errors import AutoparError


class SolverError(AutoparError):
    """The ILP solver failed or could not prove optimality."""


def available_solvers() -> list[str]:
    """Names of the usable solvers, preferred first."""
    have = pulp.listSolvers(onlyAvailable=True)
    return [name for name in ("HiGHS", "PULP_CBC_CMD") if name in have]


def make_solver(name: str = "highs", time_limit_s: float = 60.0) -> pulp.LpSolver:
    """A pulp solver: ``highs`` (in process via highspy) or ``cbc``."""
    if name == "highs" and "HiGHS" in available_solvers():
        return pulp.HiGHS(msg=False, timeLimit=time_limit_s)
    if name in ("highs", "cbc"):
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s)
    raise SolverError(f"unknown solver {name!r}; use 'highs' or 'cbc'.")


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """HiGHS prints a banner on file descriptor 1 even with msg=False; keep the user's
    output clean. Descriptor 1 itself is redirected (under Jupyter ``sys.stdout`` is not
    descriptor 1, but HiGHS still writes there)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no descriptor 1 at all
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def solve(problem: pulp.LpProblem, solver: pulp.LpSolver) -> float:
    """Solve ``problem`` to proven optimality and return the objective value."""
    with _quiet_stdout():
        problem.solve(solver)
    status = pulp.LpStatus[problem.status]
    if status != "Optimal" or problem.sol_status != pulp.LpSolutionOptimal:
        raise SolverError(
            f"ILP {problem.name!r} ended with status {status!r} (solution status "
            f"{pulp.LpSolution.get(problem.sol_status, problem.sol_status)!r}); it was not proven optimal. "
            f"Raise the time limit or report the model."
        )
    value = pulp.value(problem.objective)
    return float(value) if value is not None else 0.0
