"""The runtime notebook runs four plans on 2 processes and compares them with their predictions."""

import re

import pytest

from .conftest import has_png, run_notebook, text_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUMBER = r"[\d.]+(?:e[+-]\d+)?"
PLANS = ("data parallel", "tensor parallel", "pipeline parallel", "planner's choice")

# Measured over predicted step time. The profile and the runs are minutes apart on a shared
# 2-core machine, so other jobs slow some runs and not others: ratios of 1.1-2.9 were seen
# here, and 4.5 once when a test suite started between the profile and the runs. The band
# catches predictions of the wrong size (a unit or a per-micro-batch slip), not noise.
STEP_RATIO = (0.25, 5.0)
# Measured over predicted peak memory: both count tensor bytes, so this is deterministic
# (1.03-1.28 measured); the runtime's own bookkeeping may add, a plan's unit never halves.
MEMORY_RATIO = (0.5, 2.0)


def test_runtime(tmp_path):
    out = run_notebook("runtime.ipynb", tmp_path)
    assert "gloo 2 ranks on 1 node(s)" in text_of(out["profile"])

    configs = dict(re.findall(r"^(.+?) +(dp=\d+ tp=\d+ pp=\d+ .*)$", text_of(out["plans"]), re.MULTILINE))
    assert tuple(configs) == PLANS
    assert configs["data parallel"].startswith("dp=2 tp=1 pp=1 mbs=4")
    assert configs["tensor parallel"].startswith("dp=1 tp=2 pp=1 mbs=4")
    assert configs["pipeline parallel"].startswith("dp=1 tp=1 pp=2 mbs=4")
    dp, tp, pp = map(int, re.match(r"dp=(\d+) tp=(\d+) pp=(\d+)", configs["planner's choice"]).groups())
    assert dp * tp * pp == 2

    rows = re.findall(rf"^(.+?) +({NUMBER}) +({NUMBER}) +({NUMBER}) +(rank 0: .*)$", text_of(out["table"]),
                      re.MULTILINE)
    assert tuple(r[0] for r in rows) == PLANS
    for name, predicted, measured, ratio, peaks in rows:
        predicted, measured, ratio = float(predicted), float(measured), float(ratio)
        assert predicted > 0 and measured > 0
        assert ratio == pytest.approx(measured / predicted, abs=0.01)
        assert STEP_RATIO[0] < ratio < STEP_RATIO[1], f"{name}: measured {measured} s, predicted {predicted} s"
        per_rank = re.findall(rf"rank (\d): ({NUMBER}) / ({NUMBER})", peaks)
        assert [int(r) for r, _, _ in per_rank] == [0, 1]
        for rank, pred_mib, meas_mib in per_rank:
            assert MEMORY_RATIO[0] < float(meas_mib) / float(pred_mib) < MEMORY_RATIO[1], f"{name} rank {rank}"
        if name in ("data parallel", "tensor parallel"):
            assert per_rank[0][1:] == per_rank[1][1:], f"{name}: both ranks hold the same shard sizes"
    pipeline_ranks = dict(zip(PLANS, (r[4] for r in rows)))["pipeline parallel"]
    assert len(set(re.findall(rf"rank \d: ({NUMBER}) /", pipeline_ranks))) == 2, "pp stages are predicted apart"

    losses = {name: [float(x) for x in values.split()]
              for name, values in re.findall(r"^(.+?) +((?:\d+\.\d+ ?){6})$", text_of(out["losses"]), re.MULTILINE)}
    assert tuple(losses) == PLANS
    reference = losses["data parallel"]
    assert reference[-1] < reference[0] - 0.2, "training lowers the loss"
    for name, curve in losses.items():
        assert curve == pytest.approx(reference, abs=2e-3), f"{name} trains the same model as data parallel"

    for tag in ("times_figure", "losses", "timeline", "memory", "step"):
        assert has_png(out[tag]), f"{tag} shows a picture"

    direct = text_of(out["parallelize"])
    whole = int(re.search(r"whole model: ([\d,]+) parameters", direct).group(1).replace(",", ""))
    ranks = re.findall(r"rank (\d) \{'pp': (\d), 'dp': 0, 'cp': 0, 'tp': 0\}: (.+); ([\d,]+) parameters", direct)
    assert [(r, p) for r, p, _, _ in ranks] == [("0", "0"), ("1", "1")]
    assert ranks[0][2].startswith("tok_embeddings") and ranks[1][2].endswith("norm, output")
    held = sum(int(n.replace(",", "")) for _, _, _, n in ranks)
    assert held - whole == 2048 * 256, "the head's tied copy of the token embedding is the only duplicate"
    curves = [[float(x) for x in c.split()] for c in re.findall(r"losses ([\d. ]+)$", direct, re.MULTILINE)]
    assert len(curves) == 2 and curves[0] == curves[1], "job.step returns the same loss on every rank"
    assert len(curves[0]) == 8 and curves[0][-1] < curves[0][0] - 0.2
    lasts = re.findall(rf"last step ({NUMBER}) s, peak ({NUMBER}) MiB", direct)
    assert len(lasts) == 2 and all(float(s) > 0 and float(m) > 0 for s, m in lasts)
