"""Writes fake sysfs trees of machines we do not have, for the topology tests (tests/test_runtime.py):

    tests/data/topology/xeon-2s-smt/      2 sockets x 8 cores x 2 threads, one NUMA node per socket;
                                          Linux numbering: first threads of socket 0, of socket 1, then
                                          the second threads; core_id repeats across sockets and has
                                          gaps (as on Xeon Scalable)
    tests/data/topology/alderlake-8p8e/   Core i9-12900K: 8 P-cores with SMT (siblings adjacent: 0-1, 2-3
                                          ...), 8 E-cores in two modules of 4 sharing an L2; hybrid PMU
                                          lists devices/cpu_core and devices/cpu_atom
    tests/data/topology/epyc-4node/       EPYC 7313 in NPS4: 16 cores x 2 threads, 4 NUMA nodes of one
                                          CCD each (4 cores sharing a 32 MiB L3); newer kernels'
                                          core_cpus_list instead of thread_siblings_list

Only the files corelm reads are written: devices/system/cpu/online, cpuN/topology/*,
cpuN/cache/indexM/{level,type,size,shared_cpu_list}, devices/system/node/nodeN/cpulist and the hybrid
lists. Deterministic; `--check` compares the committed trees with what would be written.

    python tools/make_fake_topology.py [--out tests/data/topology] [--check]
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "tests", "data", "topology")


def cpu_list(cpus) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2,5,7-8", the kernel's format."""
    cpus = sorted(set(cpus))
    parts, i = [], 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts)


class Machine:
    """Logical CPUs with their core, package and node, the caches each sees, and the hybrid lists."""

    def __init__(self, siblings_file: str = "thread_siblings_list"):
        self.siblings_file = siblings_file
        self.cpus: Dict[int, dict] = {}
        self.hybrid: Dict[str, List[int]] = {}

    def core(self, cpus, package: int, core_id: int, node: int, caches) -> None:
        """One physical core: its logical CPUs and [(level, type, size, shared CPUs), ...]."""
        for cpu in cpus:
            self.cpus[cpu] = dict(package=package, core_id=core_id, node=node, siblings=list(cpus),
                                  caches=caches)

    def files(self) -> Dict[str, str]:
        out = {"devices/system/cpu/online": cpu_list(self.cpus) + "\n"}
        nodes: Dict[int, List[int]] = {}
        for cpu, c in sorted(self.cpus.items()):
            nodes.setdefault(c["node"], []).append(cpu)
            top = f"devices/system/cpu/cpu{cpu}/topology/"
            out[top + "physical_package_id"] = f"{c['package']}\n"
            out[top + "core_id"] = f"{c['core_id']}\n"
            out[top + self.siblings_file] = cpu_list(c["siblings"]) + "\n"
            for index, (level, kind, size, shared) in enumerate(c["caches"]):
                d = f"devices/system/cpu/cpu{cpu}/cache/index{index}/"
                out[d + "level"] = f"{level}\n"
                out[d + "type"] = f"{kind}\n"
                out[d + "size"] = f"{size}\n"
                out[d + "shared_cpu_list"] = cpu_list(shared) + "\n"
        for node, cpus in nodes.items():
            out[f"devices/system/node/node{node}/cpulist"] = cpu_list(cpus) + "\n"
        for pmu, cpus in self.hybrid.items():
            out[f"devices/{pmu}/cpus"] = cpu_list(cpus) + "\n"
        return out


def xeon_2s_smt() -> Machine:
    m = Machine()
    sockets, cores = 2, 8
    core_ids = [0, 1, 2, 3, 4, 8, 9, 10]          # gaps, and the same ids on both sockets
    for s in range(sockets):
        socket_cpus = [s * cores + k for k in range(cores)] + [(sockets + s) * cores + k for k in range(cores)]
        l3 = (3, "Unified", "61440K", socket_cpus)
        for k in range(cores):
            cpus = [s * cores + k, (sockets + s) * cores + k]
            m.core(cpus, package=s, core_id=core_ids[k], node=s,
                   caches=[(1, "Data", "48K", cpus), (1, "Instruction", "32K", cpus),
                           (2, "Unified", "2048K", cpus), l3])
    return m


def alderlake_8p8e() -> Machine:
    m = Machine()
    everyone = list(range(24))
    l3 = (3, "Unified", "30720K", everyone)
    for k in range(8):                               # P-cores: cpus 2k, 2k+1
        cpus = [2 * k, 2 * k + 1]
        m.core(cpus, package=0, core_id=4 * k, node=0,
               caches=[(1, "Data", "48K", cpus), (1, "Instruction", "32K", cpus),
                       (2, "Unified", "1280K", cpus), l3])
    for k in range(8):                               # E-cores: cpus 16-23, L2 per module of 4
        cpu = 16 + k
        module = list(range(16 + 4 * (k // 4), 20 + 4 * (k // 4)))
        m.core([cpu], package=0, core_id=32 + k, node=0,
               caches=[(1, "Data", "32K", [cpu]), (1, "Instruction", "64K", [cpu]),
                       (2, "Unified", "2048K", module), l3])
    m.hybrid = {"cpu_core": list(range(16)), "cpu_atom": list(range(16, 24))}
    return m


def epyc_4node() -> Machine:
    m = Machine(siblings_file="core_cpus_list")
    cores = 16
    for k in range(cores):
        ccd = k // 4
        cpus = [k, cores + k]
        ccd_cpus = [c for j in range(4 * ccd, 4 * ccd + 4) for c in (j, cores + j)]
        m.core(cpus, package=0, core_id=k, node=ccd,
               caches=[(1, "Data", "32K", cpus), (1, "Instruction", "32K", cpus),
                       (2, "Unified", "512K", cpus), (3, "Unified", "32768K", ccd_cpus)])
    return m


MACHINES = {"xeon-2s-smt": xeon_2s_smt, "alderlake-8p8e": alderlake_8p8e, "epyc-4node": epyc_4node}


def tree_files(name: str) -> Dict[str, str]:
    return MACHINES[name]().files()


def write_tree(root: str, files: Dict[str, str]) -> None:
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="ascii", newline="\n") as f:
            f.write(text)


def read_tree(root: str) -> Dict[str, str]:
    found = {}
    for dirpath, _, names in os.walk(root):
        for n in names:
            path = os.path.join(dirpath, n)
            with open(path, encoding="ascii") as f:
                found[os.path.relpath(path, root).replace(os.sep, "/")] = f.read()
    return found


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--check", action="store_true", help="compare the trees under --out, write nothing")
    args = ap.parse_args(argv)
    stale = []
    for name in MACHINES:
        root = os.path.join(args.out, name)
        if args.check:
            if read_tree(root) != tree_files(name):
                stale.append(name)
        else:
            write_tree(root, tree_files(name))
            print(f"{root}: {len(tree_files(name))} files")
    if stale:
        print("out of date: " + ", ".join(stale) + " (run tools/make_fake_topology.py)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
