"""Small integer programs, built as arrays and solved to proven optimality.

:class:`Program` collects variables (bounds, integrality, objective) and linear
constraints; :func:`solve` hands them to HiGHS in process (``highspy``, the default: a
few hundred microseconds for the planner's programs, where building a ``pulp`` model
costs tens of milliseconds) or to CBC through ``pulp``. Either answer is checked: a
time-limited CBC run can report "Optimal" for a solution it did not prove, so the
solution status is checked too, and anything short of a proven optimum raises.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from autopar.errors import AutoparError

SOLVERS = ("highs", "cbc")
TIME_LIMIT_S = 60.0


class SolverError(AutoparError):
    """The solver failed or could not prove optimality."""


class Infeasible(SolverError):
    """The program has no solution."""


@dataclass
class Program:
    """A minimisation over variables with bounds, some integer, under linear constraints
    ``lower <= sum(coef * var) <= upper``."""

    name: str
    cost: list[float] = field(default_factory=list)
    lower: list[float] = field(default_factory=list)
    upper: list[float] = field(default_factory=list)
    integer: list[bool] = field(default_factory=list)
    rows: list[tuple[dict[int, float], float, float]] = field(default_factory=list)

    def var(self, *, lower: float = 0.0, upper: float = math.inf, integer: bool = False, cost: float = 0.0) -> int:
        """A new variable; its index."""
        self.cost.append(cost)
        self.lower.append(lower)
        self.upper.append(upper)
        self.integer.append(integer)
        return len(self.cost) - 1

    def binary(self, cost: float = 0.0) -> int:
        """A new 0/1 variable."""
        return self.var(lower=0.0, upper=1.0, integer=True, cost=cost)

    def constrain(self, coefs: dict[int, float], *, lower: float = -math.inf, upper: float = math.inf) -> None:
        """``lower <= sum(coefs[v] * v) <= upper``."""
        self.rows.append((coefs, lower, upper))


def check_solver(name: str) -> str:
    """``name`` if it is a solver autopar knows, else SolverError naming the choices."""
    if name not in SOLVERS:
        raise SolverError(f"unknown solver {name!r}; use one of {', '.join(SOLVERS)}.")
    return name


def solve(program: Program, solver: str = "highs") -> list[float]:
    """The values of ``program``'s variables at its proven optimum; :class:`Infeasible`
    when it has none, :class:`SolverError` when the optimum was not proven."""
    check_solver(solver)
    if solver == "highs":
        return _highs(program)
    return _cbc(program)


def _highs(program: Program) -> list[float]:
    import highspy

    with _quiet_stdout():  # the first Highs() of a process prints a banner on descriptor 1
        h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", TIME_LIMIT_S)
    h.setOptionValue("mip_rel_gap", 1e-4)  # exact: HiGHS stops at a 1e-4 gap by default
    h.setOptionValue("mip_abs_gap", 1e-6)
    lp = highspy.HighsLp()
    lp.num_col_ = len(program.cost)
    lp.num_row_ = len(program.rows)
    lp.col_cost_ = np.asarray(program.cost, dtype=float)
    lp.col_lower_ = np.asarray(program.lower, dtype=float)
    lp.col_upper_ = np.where(np.isinf(program.upper), highspy.kHighsInf, program.upper)
    lp.row_lower_ = np.array([-highspy.kHighsInf if math.isinf(lo) else lo for _, lo, _ in program.rows], dtype=float)
    lp.row_upper_ = np.array([highspy.kHighsInf if math.isinf(up) else up for _, _, up in program.rows], dtype=float)
    starts, index, value = [0], [], []
    for coefs, _, _ in program.rows:
        index.extend(coefs)
        value.extend(coefs.values())
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_ = np.asarray(starts, dtype=np.int32)
    lp.a_matrix_.index_ = np.asarray(index, dtype=np.int32)
    lp.a_matrix_.value_ = np.asarray(value, dtype=float)
    lp.integrality_ = [
        highspy.HighsVarType.kInteger if i else highspy.HighsVarType.kContinuous for i in program.integer
    ]
    h.passModel(lp)
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        raise Infeasible(f"program {program.name!r} has no solution.")
    if status != highspy.HighsModelStatus.kOptimal:
        raise SolverError(
            f"program {program.name!r} ended with HiGHS status {h.modelStatusToString(status)!r}; it was not proven "
            f"optimal. Report the model, or try solver='cbc'."
        )
    return list(h.getSolution().col_value)


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """File descriptor 1 to /dev/null (under Jupyter ``sys.stdout`` is not descriptor 1,
    but HiGHS writes there)."""
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


def _cbc(program: Program) -> list[float]:
    import pulp

    prob = pulp.LpProblem(program.name, pulp.LpMinimize)
    xs = [
        prob.add_variable(
            f"v{i}",
            lowBound=lo,
            upBound=None if math.isinf(up) else up,
            cat="Integer" if integer else "Continuous",
        )
        for i, (lo, up, integer) in enumerate(zip(program.lower, program.upper, program.integer))
    ]
    for coefs, lo, up in program.rows:
        expr = pulp.lpSum(c * xs[v] for v, c in coefs.items())
        if lo == up:
            prob += expr == lo
        else:
            if not math.isinf(lo):
                prob += expr >= lo
            if not math.isinf(up):
                prob += expr <= up
    prob += pulp.lpSum(c * x for c, x in zip(program.cost, xs) if c)
    prob.solve(pulp.PULP_CBC_CMD(msg=False, timeLimit=TIME_LIMIT_S))
    status = pulp.LpStatus[prob.status]
    if status == "Infeasible":
        raise Infeasible(f"program {program.name!r} has no solution.")
    if status != "Optimal" or prob.sol_status != pulp.LpSolutionOptimal:
        raise SolverError(
            f"program {program.name!r} ended with CBC status {status!r} (solution status "
            f"{pulp.LpSolution.get(prob.sol_status, prob.sol_status)!r}); it was not proven optimal. Raise the time "
            f"limit or use solver='highs'."
        )
    return [x.value() or 0.0 for x in xs]
