"""Benchmark CLI: `python -m benchmarks.bench forward ...`, `... index ...`, `... gate ...` or `... host-ceiling ...`.

Each subcommand's module is imported only when chosen (the index benchmark needs no model).
"""
from __future__ import annotations

import sys

USAGE = "usage: python -m benchmarks.bench {forward,index,gate,host-ceiling} [options]  (--help after the subcommand)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "forward":
        from benchmarks import bench_forward

        return bench_forward.main(rest) or 0
    if command == "index":
        from benchmarks import bench_index

        return bench_index.main(rest) or 0
    if command == "gate":
        from benchmarks import bench_gate

        return bench_gate.main(rest) or 0
    if command == "host-ceiling":
        from benchmarks import host_ceiling

        return host_ceiling.main(rest) or 0
    print(f"unknown benchmark {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
