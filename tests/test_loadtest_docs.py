"""The commands and metric names in README.md and docs/ stay true: every `radixserve-loadtest` and
`radixserve` command line (in the docs' bash blocks and in the scripts of benchmarks/recipes/ they
point to) parses with today's flags (including the radixserve flags inside each
`--server "NAME: FLAGS"`), and every metric name the docs mention is a registered series."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from loadtest import cli, compare

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RECIPES = sorted((ROOT / "benchmarks" / "recipes").glob("*.sh"))


def _command_lines() -> list[tuple[str, str]]:
    """(file, command) for every radixserve / radixserve-loadtest command in a bash block or a recipe."""
    blocks = [(path, block) for path in DOCS
              for block in re.findall(r"```bash\n(.*?)```", path.read_text(), flags=re.S)]
    blocks += [(path, path.read_text()) for path in RECIPES]
    out = []
    for path, block in blocks:
        for line in block.replace("\\\n", " ").splitlines():
            for cmd in line.split("#")[0].split("&&"):
                cmd = re.split(r"\s\d?>", cmd)[0]  # the command, not its output redirections
                cmd = cmd.strip().rstrip("&").strip()
                if cmd.startswith(("radixserve ", "radixserve-loadtest ")):
                    out.append((path.name, cmd))
    return out


def test_docs_have_commands():
    files = {f for f, _ in _command_lines()}
    assert {"README.md", "loadtest.md", "cpu.md", "operations.md", "batch_vs_server.sh"} <= files


@pytest.mark.parametrize("where,cmd", _command_lines())
def test_doc_command_parses(where, cmd):
    server_cli = pytest.importorskip("server.cli")
    words = shlex.split(cmd)
    if words[0] == "radixserve" and words[1:2] and words[1] in server_cli.BATCH_COMMANDS:
        from server.batch import command as batch_cli

        config = batch_cli.config_from(batch_cli.build_parser().parse_args(words[2:]))
        assert config.model_id
        return
    if words[0] == "radixserve":
        server_cli.build_parser().parse_args(words[1:])
        return
    args = cli.build_parser().parse_args(words[1:])
    for spec in getattr(args, "server", None) or []:
        target = compare.parse_server(spec)
        if not target.baseline:
            parser = server_cli.build_parser()
            parser.parse_args(list(target.flags))


def test_doc_metric_names_are_registered():
    from scheduler import metrics

    # Every family the registry holds, labelled ones included even before a label is set.
    families = {family.name for family in metrics.Metrics().registry.collect()}
    suffixes = ("", "_total", "_bucket", "_sum", "_count", "_created")
    exposed = {name + suffix for name in families for suffix in suffixes}
    text = "\n".join(p.read_text() for p in DOCS)
    # A name after "lua." is the router's HAProxy fetch (deploy/haproxy/prefix_key.lua), not a metric.
    named = set(re.findall(r"(?<!lua\.)\b((?:te|radixserve)_[a-z_]*[a-z])\b", text))
    assert named, "the docs name no metrics"
    unknown = sorted(n for n in named if n not in exposed and n not in families)
    assert not unknown, unknown
