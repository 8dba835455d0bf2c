"""Which CPUs each process of a group gets (batch workers, tensor-parallel ranks): one NUMA node each
where there are enough nodes, else disjoint contiguous slices of the CPUs the parent may use (so each
process's weights, first touched by its own pinned threads, stay in its node's memory)."""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence


def numa_nodes(root: Optional[str] = None) -> Dict[int, List[int]]:
    """{node id: its CPUs} as the engine layer reports the C++ core's topology (sysfs below root,
    default this machine: only the core reads sysfs); {} when it cannot tell."""
    from .system import topology_info
    topo = topology_info(root)
    nodes: Dict[int, List[int]] = {}
    for cpu in topo["cpus"] if topo else ():   # no core: split_cpus slices the allowed CPUs without nodes
        nodes.setdefault(cpu["node"], []).append(cpu["id"])
    return {node: sorted(ids) for node, ids in sorted(nodes.items())}


def allowed_cpus() -> List[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:       # not Linux
        return list(range(os.cpu_count() or 1))


def split_cpus(workers: int, cpus: Optional[Sequence[int]] = None,
               nodes: Optional[Dict[int, Sequence[int]]] = None) -> List[List[int]]:
    """Disjoint CPU sets, one per worker. `cpus`: the CPUs allowed (default: this process's
    affinity); `nodes`: {node: CPUs} (default: numa_nodes()). Workers are spread over the nodes that have
    allowed CPUs as evenly as possible (worker i on node i when there are at least as many nodes as
    workers), and a node shared by several workers is cut into contiguous slices. With more workers
    than CPUs, sets repeat CPUs round-robin (they cannot be disjoint)."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}.")
    allowed = sorted(set(allowed_cpus() if cpus is None else cpus))
    nodes = numa_nodes() if nodes is None else nodes
    groups = [sorted(set(c) & set(allowed)) for _, c in sorted(nodes.items())]
    groups = [g for g in groups if g]
    placed = set(c for g in groups for c in g)
    rest = [c for c in allowed if c not in placed]       # CPUs no node named (or no node list)
    if rest:
        groups.append(rest)
    if workers > len(allowed):
        return [[allowed[i % len(allowed)]] for i in range(workers)]
    # Workers per node: round-robin over nodes, but never more workers than a node has CPUs.
    counts = [0] * len(groups)
    for i in range(workers):
        order = sorted(range(len(groups)), key=lambda g: (counts[g] / len(groups[g]), -len(groups[g]), g))
        pick = next(g for g in order if counts[g] < len(groups[g]))
        counts[pick] += 1
    sets: List[List[int]] = []
    for g, k in zip(groups, counts):
        for j in range(k):
            sets.append(g[len(g) * j // k: len(g) * (j + 1) // k])
    return sets
