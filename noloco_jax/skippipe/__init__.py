"""SkipPipe in miniature: path rules, a scheduler and an iteration-time simulator.

The scheduler and simulator are pure Python/NumPy, deterministic given seeds. Training with skipped
stages lives in ``noloco_jax.skippipe.training``.

    net = skippipe.geo_distributed(18, forward_s=1.76)
    part = skippipe.partition_nodes(net, skippipe.default_stage_sizes(18, 4), message_bytes=16e6)
    rules = skippipe.PathRules(num_stages=4, path_length=3)
    sched = skippipe.make_schedule("skippipe", net, part, rules, message_bytes=16e6)
    skippipe.simulate(net, sched.paths, memory=3, message_bytes=16e6).makespan_s
"""

from noloco_jax.skippipe.network import (
    REGIONS,
    Network,
    five_clusters,
    from_locations,
    geo_distributed,
    region_link,
    single_cluster,
)
from noloco_jax.skippipe.partition import (
    default_stage_sizes,
    partition_nodes,
    pipeline_cost,
    stage_of_nodes,
)
from noloco_jax.skippipe.paths import PathRules, check_path, check_stage_path, valid_stage_paths
from noloco_jax.skippipe.scheduler import (
    SCHEDULES,
    Interval,
    Schedule,
    full_pipeline_chains,
    make_schedule,
)
from noloco_jax.skippipe.simulator import SimResult, TraceEvent, memory_from_trace, simulate

__all__ = [
    "REGIONS",
    "Network",
    "from_locations",
    "geo_distributed",
    "five_clusters",
    "single_cluster",
    "region_link",
    "default_stage_sizes",
    "partition_nodes",
    "pipeline_cost",
    "stage_of_nodes",
    "PathRules",
    "check_path",
    "check_stage_path",
    "valid_stage_paths",
    "SCHEDULES",
    "Interval",
    "Schedule",
    "full_pipeline_chains",
    "make_schedule",
    "SimResult",
    "TraceEvent",
    "memory_from_trace",
    "simulate",
]
