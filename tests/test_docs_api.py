"""docs/api.md stays the contract the code has: its tables are compared with the code's own.

- the flag table with ``radixserve --help`` (the console script named in pyproject.toml) and with
  ``ServerConfig``'s fields: every flag documented once, no documented flag that does not exist,
  each row's variable, default and choices as the config defines them;
- the route table with the routes the app serves (``server.app.create_app``);
- the /info table with the fields a running app answers, and the metrics table with the series
  its /metrics exposes, names and types as written there.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import importlib
import io
import re
import sys
from pathlib import Path

import httpx
import pytest

from server.config import ServerConfig, env_var, flag_name

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "api.md"


def section(title: str) -> str:
    """The text under a heading of docs/api.md, up to the next heading of the same or a higher level."""
    text = DOC.read_text()
    m = re.search(rf"^(#+) {re.escape(title)}\n", text, flags=re.M)
    assert m, f"docs/api.md has no heading {title!r}"
    rest = text[m.end():]
    end = re.search(rf"^#{{1,{len(m.group(1))}}} ", rest, flags=re.M)
    return rest[: end.start()] if end else rest


def table(title: str) -> list[list[str]]:
    """The rows (cells stripped) of the first Markdown table under ``title``, header excluded."""
    lines: list[str] = []
    for ln in section(title).splitlines():
        if ln.startswith("|"):
            lines.append(ln)
        elif lines:
            break  # the end of the first table
    assert len(lines) > 2 and set(lines[1]) <= set("|-: "), f"no table under {title!r}"
    # NOTE: no cell of these tables holds a "|" (not even in code spans).
    return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines[2:]]


def code_spans(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


# -- the flags ---------------------------------------------------------------------------------
def help_flags(monkeypatch) -> set[str]:
    """Option strings that ``radixserve --help`` lists (argparse's own -h/--help left out)."""
    # NOTE: read from pyproject.toml, not the installed metadata, which may predate this checkout
    # (and without tomllib: Python 3.10 is supported).
    scripts = (ROOT / "pyproject.toml").read_text().split("[project.scripts]", 1)[1]
    module, func = re.search(r'^radixserve\s*=\s*"([\w.]+):(\w+)"', scripts, flags=re.M).groups()
    main = getattr(importlib.import_module(module), func)
    monkeypatch.setattr(sys, "argv", ["radixserve", "--help"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 0
    options = out.getvalue().split("\noptions:\n", 1)[1]
    flags = set()
    for line in options.splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line)  # "  -p PORT, --port PORT   listen port"
        if m:
            flags |= {part.split()[0] for part in m.group(1).split(", ")}
    return flags - {"-h", "--help"}


def rendered_default(f: dataclasses.Field) -> str | None:
    """How the flag table writes a field's default: None for unset, else the value as typed."""
    value = f.default
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def documented_flags() -> dict[str, list[str]]:
    """flag -> its row; each row's first cell holds the flag (and its short form) in code spans."""
    rows: dict[str, list[str]] = {}
    for row in table("Command line"):
        assert len(row) == 4, f"a flag row has flag | variable | default | meaning: {row}"
        names = code_spans(row[0])
        assert names and names[0].startswith("--"), row
        assert names[0] not in rows, f"{names[0]} documented twice"
        rows[names[0]] = row
    return rows


def test_every_flag_of_radixserve_help_is_documented_and_no_other(monkeypatch):
    fields = {flag_name(f.name): f for f in dataclasses.fields(ServerConfig)}
    shorts = {f.metadata["short"] for f in fields.values() if f.metadata["short"]}
    shorts |= {alias for f in fields.values() for alias in f.metadata["aliases"]}  # spelled-out aliases
    rows = documented_flags()
    documented = set(rows) | {s for row in rows.values() for s in code_spans(row[0])[1:]}
    assert help_flags(monkeypatch) == set(fields) | shorts, "radixserve --help and ServerConfig disagree"
    assert set(rows) - set(fields) == set(), "documented flags that radixserve does not have"
    assert set(fields) - set(rows) == set(), "flags missing from docs/api.md"
    assert documented == set(fields) | shorts


def test_each_documented_flag_says_its_variable_default_and_choices():
    rows = documented_flags()
    for f in dataclasses.fields(ServerConfig):
        flag, meta = flag_name(f.name), f.metadata
        cell_flags, cell_env, cell_default, cell_meaning = rows[flag]
        assert code_spans(cell_flags)[1:] == ([meta["short"]] if meta["short"] else []) + list(meta["aliases"]), flag
        assert code_spans(cell_env) == [env_var(f.name)], flag
        want = rendered_default(f)
        if want is None:
            assert cell_default.startswith("unset"), f"{flag}: default is unset, the doc says {cell_default!r}"
        else:
            spans = code_spans(cell_default)
            assert spans and cell_default.startswith("`") and spans[0] == want, \
                f"{flag}: default {want!r}, the doc says {cell_default!r}"
        for choice in meta["choices"]:
            assert f"`{choice}`" in cell_meaning, f"{flag}: choice {choice!r} not named"
        if meta["inert"]:
            assert "no effect" in cell_meaning, f"{flag} has no effect here; the doc must say so"


# -- the running app ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def app(tiny_embedding_dir):
    from server.app import create_app

    return create_app(ServerConfig(model_id=str(tiny_embedding_dir)))


def app_routes(app) -> set[tuple[str, str]]:
    """(method, path) of everything the app routes; a mount is ("GET", "PATH/*")."""
    from starlette.routing import Mount

    found: set[tuple[str, str]] = set()

    def walk(routes, prefix: str) -> None:
        for r in routes:
            if isinstance(r, Mount):
                found.add(("GET", prefix + r.path + "/*"))
            elif hasattr(r, "methods") and hasattr(r, "path"):
                path = re.sub(r"\{(\w+):\w+\}", r"{\1}", prefix + r.path)  # {model_id:path} -> {model_id}
                found.update((m, path) for m in r.methods - {"HEAD"})
            elif hasattr(r, "original_router"):  # FastAPI includes routers lazily
                walk(r.original_router.routes, prefix + r.include_context.prefix)
            else:
                raise AssertionError(f"a route of unknown type {type(r).__name__}: extend this walk")

    walk(app.routes, "")
    return found


def test_route_table_is_the_apps_routes(app):
    documented = []
    for row in table("Routes"):
        spans = code_spans(row[0])
        assert len(spans) == 1 and " " in spans[0], f"one `METHOD /path` per row: {row[0]}"
        method, path = spans[0].split(" ", 1)
        documented.append((method, path))
    assert len(documented) == len(set(documented)), "a route documented twice"
    served = app_routes(app)
    schema = {(m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops}
    assert schema <= served, "the walk over the app's routes missed some the OpenAPI schema lists"
    assert served - set(documented) == set(), "routes missing from docs/api.md"
    assert set(documented) - served == set(), "documented routes the app does not serve"


def get(app, path: str) -> httpx.Response:
    async def call():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://docs") as client:
            return await client.get(path)

    return asyncio.run(call())


def test_info_table_is_what_info_answers(app):
    r = get(app, "/info")
    assert r.status_code == 200, r.text
    documented = [code_spans(row[0])[0] for row in table("/info")]
    assert len(documented) == len(set(documented))
    assert set(documented) == set(r.json()), "docs/api.md's /info table and GET /info disagree"


def test_metrics_table_is_what_metrics_exposes(app):
    r = get(app, "/metrics")
    assert r.status_code == 200, r.text
    exposed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", r.text, flags=re.M))
    families = {name for name, kind in exposed.items() if kind in ("counter", "histogram")}
    bases = families | {n.removesuffix("_total") for n in families}
    exposed = {n: k for n, k in exposed.items()
               if not (n.endswith("_created") and k == "gauge" and n.removesuffix("_created") in bases)}
    documented = {}
    for row in table("Metrics"):
        name, kind = code_spans(row[0])[0], row[1]
        assert name not in documented, f"{name} documented twice"
        documented[name] = kind
    assert documented == exposed, "docs/api.md's metrics table and GET /metrics disagree"


def test_retry_after_values_in_the_docs_are_the_servers():
    """Every ``Retry-After: N`` the docs promise is the value the server sends in that case."""
    from server.http.errors import RETRY_AFTER
    from server.http.lifecycle import RETRY_AFTER_S

    expected = {"drain": str(RETRY_AFTER_S), "worker": RETRY_AFTER[503], "429": RETRY_AFTER[429]}
    checked = 0
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for paragraph in re.split(r"\n\s*\n", doc.read_text()):
            for row in paragraph.split("\n|"):  # table rows apart; prose lines stay joined
                start = 0
                for m in re.finditer(r"Retry-After: (\d+)", row):
                    window = row[start:m.start()].lower()
                    start = m.end()
                    case = next((c for c in ("drain", "worker", "429") if c in window), None)
                    if case is not None:
                        assert m.group(1) == expected[case], (doc.name, case, row)
                        checked += 1
    assert checked >= 5
