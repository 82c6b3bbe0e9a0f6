"""Planning a pipeline above `graph` and `schedule`: where to cut a model.

`mpmd.balance` profiles a model's units on one microbatch (`profile`) and
searches the splits into stages on the simulator (`search`), through the
public lowering path (`schedule.Lowering`, `Program.predict`), as any future
planner (a schedule chooser, a memory planner) would:

- `units.py`: the candidate units, from the model's module calls;
- `profiler.py` (`profile`): per unit forward and backward time, saved
  activation bytes, and what crosses between units;
- `splits.py` (`search`, `simulate`): the splits weighed on the simulator;
- `results.py`: `Profile`, `StageCost`, `Balance`;
- `balancer.py`: the entry point `balance` (rank 0 profiles, every rank gets
  the result) and `mpmd.trace`, which takes `num_stages=N`;
- `plan.py`: `mpmd.plan`, the schedule, stages per rank, split and number
  of microbatches weighed together;
- `split_profile.py`: each unit's I and W timed apart from its B;
- `cluster.py`: `mpmd.project`, a step at cluster scale from a machine
  description and a transformer's config, on the same simulator;
- `cluster_search.py`: `mpmd.search_cluster`, the layout (pp x tp x dp),
  schedule, microbatches and recompute that `project` prices fastest.

Units are timed boundary to boundary: a unit's forward runs from its forward
pre-hook to the next unit's, so code between modules (a residual add, a
`torch.cat`) counts for the unit before it, which is where `mpmd.trace`'s
`split_before` puts it. Backward is timed the same way, from the gradient of
one unit's inputs to the gradient of the previous unit's inputs.
"""

from .balancer import balance, trace
from .cluster import Machine, Projection, TransformerShape, project
from .cluster_search import ClusterCandidate, ClusterPlan, search_cluster
from .layouts import Layout
from .links import Link, Links, calibrate
from .plan import Candidate, Plan, plan
from .profiler import profile
from .results import Balance, Profile, StageCost, UnitTransfer
from .splits import EXHAUSTIVE_LIMIT, search, simulate

__all__ = [
    "EXHAUSTIVE_LIMIT",
    "Balance",
    "Candidate",
    "ClusterCandidate",
    "ClusterPlan",
    "Layout",
    "Link",
    "Links",
    "Machine",
    "Plan",
    "Profile",
    "Projection",
    "StageCost",
    "TransformerShape",
    "UnitTransfer",
    "balance",
    "calibrate",
    "plan",
    "profile",
    "project",
    "search",
    "search_cluster",
    "simulate",
    "trace",
]
