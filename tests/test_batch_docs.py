"""docs/batch.md's examples succeed as written: each input file with the one model its heading
names, through the commands at the top of the page (the hub ids swapped for the tiny fixtures of
the same kind; the Ray line is tests/test_batch_ray.py's).

Oracle: the job's own exit status (0: every line succeeded) and the answer lines' statuses.
"""
from __future__ import annotations

import io
import re
import shlex
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "batch.md"


def doc_parts() -> tuple[list[str], dict[str, str]]:
    """(the first bash block's command lines, {model named before a JSON block: that block})."""
    text = DOC.read_text()
    commands = re.search(r"```bash\n(.*?)```", text, re.S).group(1).strip().splitlines()  # type: ignore[union-attr]
    inputs = {}
    for m in re.finditer(r"\(`--model\s+([^`]+)`\):\n\n```json\n(.*?)```", text, re.S):
        inputs[m.group(1)] = m.group(2)
    return commands, inputs


def run_line(command: str, tmp: Path, inputs: dict[str, str], fixtures: dict[str, str], monkeypatch) -> tuple[int, bytes]:
    """Run one of the page's command lines in-process: ``cat F |`` and ``> F`` as the shell would."""
    from server import cli

    words = shlex.split(command.split("#", 1)[0])
    stdin_file = None
    if words[0] == "cat":
        stdin_file, words = words[1], words[3:]
    stdout_file = None
    if ">" in words:
        k = words.index(">")
        stdout_file, words = words[k + 1], words[:k]
    model = words[words.index("--model") + 1]
    for doc_model, body in inputs.items():  # the input file written for this model's kind
        if ("Reranker" in doc_model) == ("Reranker" in model):
            (tmp / "requests.jsonl").write_text(body)
    words[words.index("--model") + 1] = fixtures["reranker" if "Reranker" in model else "embedding"]
    argv = words[1:] if words[0] == "radixserve" else ["batch", *words[1:]]
    out = io.BytesIO()
    if stdin_file is not None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO((tmp / stdin_file).read_bytes())))
    if stdout_file is not None:
        wrapper = io.TextIOWrapper(out)
        monkeypatch.setattr(sys, "stdout", wrapper)
    monkeypatch.chdir(tmp)
    rc = cli.main(argv + ["--no-progress"])
    monkeypatch.undo()
    if stdout_file is not None:
        (tmp / stdout_file).write_bytes(out.getvalue())
    return rc, (tmp / "results.jsonl").read_bytes()


def test_the_pages_inputs_and_commands_succeed_with_one_model(tmp_path, tiny_reranker_dir, tiny_embedding_dir,
                                                              monkeypatch):
    import json

    commands, inputs = doc_parts()
    assert len(inputs) == 2 and any("Reranker" in m for m in inputs) and any("Embedding" in m for m in inputs)
    fixtures = {"reranker": str(tiny_reranker_dir), "embedding": str(tiny_embedding_dir)}
    ran = 0
    for command in commands:
        if "--ray-actors" in command:
            continue
        (tmp_path / "results.jsonl").unlink(missing_ok=True)
        rc, out = run_line(command, tmp_path, inputs, fixtures, monkeypatch)
        got = [json.loads(x) for x in out.splitlines()]
        assert rc == 0, (command, got)
        assert got and all(r["error"] is None and r["response"]["status_code"] == 200 for r in got), command
        ran += 1
    assert ran == 2
