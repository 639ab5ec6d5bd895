"""Command line: ``python -m phalanx node`` runs one node; ``python -m phalanx launch`` starts
a Python program once per node on this machine (or per node of a config's emulated hosts).

    python -m phalanx node --config cluster.toml --id 3
    python -m phalanx launch -n 4 train.py --epochs 3
    python -m phalanx launch --config cluster.toml train.py
"""

from __future__ import annotations

import argparse
import sys

from . import launch


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(prog="python -m phalanx", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("node", help="run one node of a configured cluster until stopped")
    n.add_argument("--config", required=True, help="cluster TOML file (as for the phalanx command)")
    n.add_argument("--id", type=int, default=None, help="node id (default: PHALANX_RANK)")
    n.add_argument("--rejoin", action="store_true", help="join a running cluster after a restart")
    n.add_argument("--secs", type=float, default=None, help="stop after this many seconds")
    l = sub.add_parser("launch", help="start a Python program once per node")
    l.add_argument("-n", "--nodes", type=int, default=None,
                   help="local processes on 127.0.0.1 (a config is written for them)")
    l.add_argument("--config", default=None,
                   help="cluster TOML: one process per node, in the node's namespace when the "
                        "addresses are emulated hosts (cluster/netns.sh)")
    l.add_argument("--timeout", type=float, default=3600.0, help="stop every rank after this long")
    l.add_argument("--base-port", type=int, default=0, help="first port of a written config (0: free ports)")
    l.add_argument("program", help="Python file to run")
    l.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    a = p.parse_args(argv)
    if a.cmd == "node":
        return launch.run_node(a.config, a.id, a.rejoin, a.secs)
    return launch.launch(a.program, a.args, nodes=a.nodes, config=a.config,
                         timeout=a.timeout, base_port=a.base_port)


if __name__ == "__main__":
    sys.exit(main())
