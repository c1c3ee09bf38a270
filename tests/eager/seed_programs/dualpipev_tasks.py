"""DualPipeV's per-rank task lists: plain actions and fused forward+backward tasks, their
microbatches in order, for two ranks and four microbatches."""

import json

from spectrax.runtime import DualPipeV, FusedTask, dualpipev_tasks


def describe(task):
    if isinstance(task, FusedTask):
        fwd, bwd = task.split()
        return f"F{fwd.microbatch}&B{bwd.microbatch}"
    return f"mb{task.microbatch}"


out = {}
for rank in range(2):
    tasks = dualpipev_tasks(2, rank, 4)
    out[f"rank{rank}"] = {
        "n": len(tasks),
        "fused": sum(isinstance(t, FusedTask) for t in tasks),
        "order": [describe(t) for t in tasks],
        "fwd_of_first_fused": next(t.fwd.microbatch for t in tasks if isinstance(t, FusedTask)),
    }
out["schedule"] = type(DualPipeV(4)).__name__
print(json.dumps(out))
