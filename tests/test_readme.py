"""README's two set-up commands stay true: CI runs the same test command, the demo preset exists."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)


def test_exactly_two_setup_commands():
    cmds = setup_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds), cmds
    assert "radixserve --model-id" in cmds[0]
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    readme_pytest = setup_commands()[1].split("&&")[-1].strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(readme_pytest)}(\s|$)", ci, flags=re.M), readme_pytest
    assert "torch==2.13.0" in setup_commands()[1] and "torch==2.13.0" in ci


def test_server_command_names_a_real_preset_and_flags():
    from fixtures import PRESETS
    from server.cli import build_parser

    words = shlex.split(setup_commands()[0].replace("&&", " && "))
    preset = words[words.index("--preset") + 1]
    assert preset in PRESETS
    serve = words[words.index("radixserve"):]
    args = build_parser().parse_args(serve[1:])
    assert args.model_id == words[words.index("fixtures") + 1]
