"""Write every table of measured numbers in the docs from the raw results in ``bench/results/``.

    python scripts/tables.py            # rewrite every generated region in place
    python scripts/tables.py --check    # exit 1 (naming the region) when a region differs from its results
    python scripts/tables.py --list     # the tables of the spec, with their doc and files

The tables are declared in ``bench/spec.py`` (``TABLES``). A doc holds a table between two markers::

    <!-- table:NAME -->
    ...generated: what ran (card, software, command), the table, each row linking its raw file...
    <!-- /table:NAME -->

A table whose markers are not in its doc yet is appended at the end of the doc. Reading a result:
a ``ditmesh-bench/1`` document (or any JSON with a ``rows`` list) gives its rows; a ``.jsonl`` file gives one
row per line (text before a line's first ``{`` is ignored); any other JSON document is one row. Each row carries
``_file`` (its path under ``bench/results``) and ``_doc`` (its file's top level). Torch-free; the output depends
on the files alone (sorted, no clock), so a second run writes nothing.
"""

from __future__ import annotations

import argparse
import fnmatch
import importlib.util
import itertools
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SPEC = ROOT / "bench" / "spec.py"

BEGIN = "<!-- table:{} -->"
END = "<!-- /table:{} -->"
MARKER = re.compile(r"^<!-- (/?)table:([A-Za-z0-9_.-]+) -->$", re.M)  # alone on its line


# -- reading results ---------------------------------------------------------------------------------------------
def load_spec(path: Path = SPEC):
    """The spec module (``TABLES``, ``SUITES``), loaded from its file."""
    spec = importlib.util.spec_from_file_location("ditmesh_bench_spec", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expand_braces(pattern: str) -> list[str]:
    """``a{1,2}-{x,y}`` -> ``a1-x, a1-y, a2-x, a2-y`` (the shell's brace expansion, not nested)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def result_files(patterns: list[str], results: Path = RESULTS) -> list[Path]:
    """The files under ``results`` matching the patterns (globs with braces), sorted; a pattern that matches
    nothing is an error (a table never silently loses rows)."""
    out = []
    for pattern in patterns:
        found = sorted({p for one in expand_braces(pattern) for p in results.glob(one) if p.is_file()})
        if not found:
            raise SystemExit(f"tables: no result file matches {pattern!r} under {results}")
        out += [p for p in found if p not in out]
    return out


def read_rows(path: Path, results: Path = RESULTS) -> list[dict]:
    """The rows of one result file, each with ``_file`` and ``_doc``."""
    rel = path.relative_to(results).as_posix()
    text = path.read_text()
    if path.suffix == ".jsonl":
        docs = [json.loads(line[line.index("{"):]) for line in text.splitlines() if "{" in line]
        return [dict(d, _file=rel, _doc=d) for d in docs]
    doc = json.loads(text)
    if isinstance(doc, list):  # a list of rows (``eval-tiny --json``)
        return [dict(r, _file=rel, _doc={}) for r in doc]
    if isinstance(doc, dict) and isinstance(doc.get("rows"), list):
        return [dict(r, _file=rel, _doc=doc) for r in doc["rows"]]
    return [dict(doc, _file=rel, _doc=doc)]


def document(path: Path, results: Path = RESULTS) -> dict:
    """A result file's top level (a ``.jsonl`` file's first line; ``{}`` for a list of rows), with ``_file``."""
    rel = path.relative_to(results).as_posix()
    text = path.read_text()
    if path.suffix == ".jsonl":
        doc = next((json.loads(line[line.index("{"):]) for line in text.splitlines() if "{" in line), {})
    else:
        doc = json.loads(text)
    return {"_file": rel, "_doc": doc if isinstance(doc, dict) else {}}


def get(row: dict, path: str):
    """A value by dotted path (``breakdown.compute_ms``; ``_doc.settings.steps``; ``list.0``); None if absent."""
    value = row
    for key in path.split("."):
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and key.lstrip("-").isdigit() and -len(value) <= int(key) < len(value):
            value = value[int(key)]
        else:
            return None
        if value is None:
            return None
    return value


def cell(value, fmt: str | None) -> str:
    """One cell: ``fmt`` a format spec (``.1f``, ``.2e``, ``.1%``) for numbers; None is empty; bools yes/no."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if fmt and isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value).replace("|", "\\|").replace("\n", " ")


# -- what ran: card, software, command -----------------------------------------------------------------------------
def manifest_commands(manifest: Path) -> dict[str, str]:
    """``bench/results/MANIFEST.md``'s command column, by each file its row names (paths under
    ``bench/results``): the command of results that do not record their own (``ditmesh generate`` reports)."""
    out: dict[str, str] = {}
    if not manifest.exists():
        return out
    folder = None
    for line in manifest.read_text().splitlines():
        if line.startswith("## "):
            folder = line[3:].split(":")[0].strip()
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if folder is None or not line.startswith("|") or len(cells) < 3 or cells[0] in ("file", "---"):
            continue
        where = ""  # a name without a folder is in the folder of the name before it (`a/x.json`, `y.json`)
        for name in re.findall(r"`([^`]+)`", cells[0]):
            where = name.rsplit("/", 1)[0] + "/" if "/" in name else where
            name = name if "/" in name else where + name
            for pattern in expand_braces(name):
                out.setdefault(f"{folder}/{pattern}", cells[2])
    return out


def command_of(doc: dict, rel: str, manifest: dict[str, str]) -> list[str]:
    """The commands that made a result file: its own ``command``/``commands``, else the manifest's line."""
    def text(c):
        if isinstance(c, dict) and "command" in c:  # a step of a script: {"name": ..., "command": [...], ...}
            c = c["command"]
        return " ".join(c) if isinstance(c, list) else str(c)

    if doc.get("commands"):
        return [f"`{text(c)}`" for c in doc["commands"]]
    if doc.get("command"):
        return [f"`{text(doc['command'])}`"]
    for pattern, line in manifest.items():
        if fnmatch.fnmatch(rel, pattern):
            return [line]
    return []


def manifest_cards(manifest: Path) -> dict[str, str]:
    """``bench/results/MANIFEST.md``'s section titles: folder -> the machine (``4× NVIDIA H100 80GB HBM3``)."""
    if not manifest.exists():
        return {}
    titles = re.findall(r"^## ([^:\n]+): ([^,\n]+)", manifest.read_text(), flags=re.M)
    return {folder.strip(): card.strip() for folder, card in titles}


def card_of(doc: dict, rel: str, cards: dict[str, str] | None = None) -> str:
    """The cards a result ran on: ``N× NAME`` from the document, else the manifest's title of its folder, else the
    folder's name (``<date>_<card>x<N>``)."""
    if doc.get("card") and doc.get("device_count"):
        return f"{doc['device_count']}× {doc['card']}"
    devices = doc.get("devices")
    if isinstance(devices, list) and devices:
        return f"{len(devices)}× {devices[0]}"
    if doc.get("cards"):
        return f"{len(doc['cards'])}× {doc.get('card') or doc['cards'][0].split(',')[0]}"
    name = doc.get("card") or doc.get("device")
    folder = rel.split("/")[0]
    if not name and (cards or {}).get(folder):
        return cards[folder]
    count = re.search(r"x(\d+)$", folder)
    if name:
        return f"{count.group(1)}× {name}" if count else str(name)
    return folder.split("_", 1)[-1]


def versions_of(doc: dict) -> str:
    """The software a result names (``versions``, else its ``torch`` / ``xfuser`` fields)."""
    v = dict(doc.get("versions") or {})
    for key in ("torch", "xfuser", "python"):
        if key in doc and isinstance(doc[key], str):
            v.setdefault(key, doc[key])
    return ", ".join(f"{k} {v[k]}" for k in v)


def provenance(rows: list[dict], manifest: dict[str, str], cards: dict[str, str] | None = None) -> list[str]:
    """The lines above a table: where each of its files (one row of each) ran and the command that made it."""
    seen: dict[str, list[str]] = {}
    for r in rows:
        rel = r["_file"]
        seen.setdefault(rel, [card_of(r["_doc"], rel, cards), versions_of(r["_doc"]),
                              "; ".join(command_of(r["_doc"], rel, manifest))])
    groups: dict[tuple, list[str]] = {}
    for rel, (card, soft, cmd) in seen.items():
        groups.setdefault((card, soft, cmd), []).append(rel)
    lines = []
    for (card, soft, cmd), files in groups.items():
        names = ", ".join(f"`{f}`" for f in files)
        lines.append(f"- {names}: {card}" + (f"; {soft}" if soft else "") + (f"; command: {cmd}" if cmd else ""))
    return lines


# -- one table ---------------------------------------------------------------------------------------------------
def table_rows(table: dict, results: Path = RESULTS) -> list[dict]:
    """A table's rows: each file's (through ``rows`` where the spec gives it), those ``where`` keeps, then
    ``derive``'s and ``order``'s work on them."""
    rows = []
    for path in result_files(table["files"], results):
        got = read_rows(path, results)
        rows += table["rows"](document(path, results)["_doc"], got or [document(path, results)]) \
            if table.get("rows") else got
    where = table.get("where")
    if callable(where):
        rows = [r for r in rows if where(r)]
    elif where:
        rows = [r for r in rows if all(get(r, k) == v for k, v in where.items())]
    if table.get("derive"):
        rows = table["derive"](rows)
    if table.get("order"):
        rows.sort(key=table["order"])
    if not rows:
        raise SystemExit(f"tables: table {table['name']!r} has no rows")
    return rows


def render(table: dict, doc_path: Path, results: Path = RESULTS, manifest: dict | None = None) -> str:
    """The text between a table's markers: provenance lines, the table with a raw-file column, a note."""
    manifest = manifest_commands(results / "MANIFEST.md") if manifest is None else manifest
    rows = table_rows(table, results)
    files = [document(path, results) for path in result_files(table["files"], results)]
    columns = table["columns"]
    head = [c[0] for c in columns] + ["raw"]
    lines = [f"<!-- generated by `python scripts/tables.py` from bench/spec.py ({table['name']}): edit the spec, "
             "not this table -->", ""]
    lines += provenance(files, manifest, manifest_cards(results / "MANIFEST.md")) + [""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for col in columns:
            value = col[1](r) if callable(col[1]) else get(r, col[1])
            cells.append(cell(value, col[2] if len(col) > 2 else None))
        link = os.path.relpath(results / r["_file"], doc_path.parent).replace(os.sep, "/")
        cells.append(f"[{Path(r['_file']).name}]({link})")
        lines.append("| " + " | ".join(cells) + " |")
    if table.get("note"):
        lines += ["", table["note"]]
    return "\n".join(lines)


def unmeasured(spec, results: Path = RESULTS) -> list[tuple[str, dict]]:
    """The suites' runs whose result file is not under ``results``: (suite, run)."""
    return [(name, run) for name, suite in spec.SUITES.items() for run in suite["runs"]
            if not any(results.glob(run["result"]))]


def render_unmeasured(spec, results: Path = RESULTS) -> str:
    """The list of runs still unmeasured, each with the command that measures it."""
    lines = ["<!-- generated by `python scripts/tables.py` from bench/spec.py (SUITES): a run leaves this list when "
             "its result file is in bench/results -->", ""]
    todo = unmeasured(spec, results)
    if not todo:
        return "\n".join(lines + ["Every run of every suite has its result in `bench/results`."])
    lines += ["| suite | run | GPUs | expected wall s | result (under `bench/results`) |", "|---|---|---|---|---|"]
    for name, run in todo:
        lines.append(f"| {name} | {run['name']} | {run['gpus']} | {run['wall_s']} | `{run['result']}` |")
    lines += ["", "Each run's command (`$OUT`: the output folder on the GPU machine):", "", "```bash"]
    lines += [f"{run['command']}" for _, run in todo] + ["```"]
    return "\n".join(lines)


# -- finding tables that are not generated ----------------------------------------------------------------------
#: a header or cell with a unit of a measurement: a time, a size, a rate, a ratio
UNIT = re.compile(r"(?<![A-Za-z])(ms|µs|us|s|GiB|GB|MiB|MB|KiB|img/s|dB|%|×|x|speed-?up)(?![A-Za-z])")
NUMBER_UNIT = re.compile(r"\d(?:\.\d+)?\s?(?:ms|µs|s|GiB|GB|MiB|MB|img/s|dB|%)(?![A-Za-z0-9])"  # 12.5 ms, 3 %
                         r"|\d\.\d+\s?[×x](?!\s*\d)")  # a speed-up (2.93×), not a product (2 × 2)


def tables_in(text: str) -> list[tuple[int, list[str]]]:
    """Every Markdown table of a text outside fenced code: (offset of its first line, its lines)."""
    out, current, start, fenced, offset = [], [], 0, False, 0
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if not fenced and line.lstrip().startswith("|"):
            if not current:
                start = offset
            current.append(line.rstrip("\n"))
        elif current:
            out.append((start, current))
            current = []
        offset += len(line)
    if current:
        out.append((start, current))
    return [(s, t) for s, t in out if len(t) >= 2 and set(t[1].replace(" ", "")) <= set("|-:")]


def has_units(lines: list[str]) -> bool:
    """Whether a table measures something: a unit in its header, or a number with a unit in a cell."""
    head = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    if any(UNIT.search(re.sub(r"`[^`]*`", "", h)) for h in head):
        return True
    return any(NUMBER_UNIT.search(re.sub(r"`[^`]*`", "", line)) for line in lines[2:])


def unsourced(text: str, kept: tuple[str, ...] = ()) -> list[int]:
    """Line numbers of the tables with units that are not inside a generated region (nor one whose first line
    starts with one of ``kept``: the spec's ``NOT_GENERATED``)."""
    inside = list(regions(text).values())
    return [text.count("\n", 0, start) + 1 for start, lines in tables_in(text)
            if has_units(lines) and not any(a <= start < b for a, b in inside) and not lines[0].startswith(kept)]


def unsourced_lines(spec, root: Path = ROOT) -> list[str]:
    """Every table with units outside a generated region, every region the spec does not declare, and every
    ``NOT_GENERATED`` entry that matches no table, as ``doc:line: what`` lines."""
    kept = getattr(spec, "NOT_GENERATED", [])
    out = []
    for path in measured_docs(root):
        text = path.read_text()
        rel = path.relative_to(root).as_posix()
        mine = tuple(head for doc, head, _ in kept if doc == rel)
        out += [f"{rel}:{line}: a table with units outside a generated region (declare it in bench/spec.py)"
                for line in unsourced(text, mine)]
        names = {t["name"] for t in spec.TABLES} | ({"unmeasured"} if getattr(spec, "SUITES", None) else set())
        out += [f"{rel}: region {name!r} has no table in bench/spec.py: declare it or take its markers out"
                for name in regions(text) if name not in names]
        heads = [lines[0] for _, lines in tables_in(text)]
        out += [f"{rel}: NOT_GENERATED names {head!r}, which no table there starts with: take it out of bench/spec.py"
                for head in mine if not any(h.startswith(head) for h in heads)]
    return out


def measured_docs(root: Path = ROOT) -> list[Path]:
    """The docs whose tables must come from results: README.md and every Markdown file under docs/."""
    return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


# -- docs --------------------------------------------------------------------------------------------------------
def regions(text: str) -> dict[str, tuple[int, int]]:
    """Each generated region of a doc: name -> (start, end) offsets of the text between its markers."""
    out, open_at = {}, {}
    for m in MARKER.finditer(text):
        closing, name = m.group(1) == "/", m.group(2)
        if not closing:
            open_at[name] = m.end()
        elif name in open_at:
            out[name] = (open_at.pop(name), m.start())
    return out


def rewrite(text: str, name: str, body: str) -> str:
    """``text`` with the region ``name`` holding ``body`` (appended at the end when it has no markers yet)."""
    block = f"\n{body}\n"
    found = regions(text).get(name)
    if found is None:
        return text.rstrip("\n") + f"\n\n{BEGIN.format(name)}{block}{END.format(name)}\n"
    start, end = found
    return text[:start] + block + text[end:]


def build(spec, root: Path = ROOT, results: Path | None = None) -> dict[Path, str]:
    """Every doc the spec's tables go into, as it should read: path -> text."""
    results = results or root / "bench" / "results"
    manifest = manifest_commands(results / "MANIFEST.md")
    texts: dict[Path, str] = {}
    for table in spec.TABLES:
        path = root / table["doc"]
        text = texts.get(path)
        if text is None:
            text = path.read_text()
        texts[path] = rewrite(text, table["name"], render(table, path, results, manifest))
    if getattr(spec, "SUITES", None):  # the suites' runs whose result is not in bench/results yet
        path = root / spec.UNMEASURED_DOC
        text = texts.get(path) or path.read_text()
        texts[path] = rewrite(text, "unmeasured", render_unmeasured(spec, results))
    return texts


def stale(spec, root: Path = ROOT, results: Path | None = None) -> list[str]:
    """The regions whose text differs from what the results make, as ``doc: region`` lines."""
    out = []
    for path, want in build(spec, root, results).items():
        have = path.read_text()
        if have == want:
            continue
        names = [n for n in regions(want) if regions(have).get(n) is None
                 or have[slice(*regions(have)[n])] != want[slice(*regions(want)[n])]]
        out += [f"{path.relative_to(root)}: {n}" for n in names] or [f"{path.relative_to(root)}"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 when a generated region is stale; write nothing")
    p.add_argument("--list", action="store_true", help="list the spec's tables")
    args = p.parse_args(argv)
    spec = load_spec()
    if args.list:
        for t in spec.TABLES:
            print(f"{t['name']}: {t['doc']} <- {', '.join(t['files'])}")
        return 0
    if args.check:
        bad = stale(spec)
        for line in bad:
            print(f"tables: stale: {line} (run python scripts/tables.py)", file=sys.stderr)
        for line in unsourced_lines(spec):
            bad.append(line)
            print(f"tables: {line}", file=sys.stderr)
        return 1 if bad else 0
    for path, text in build(spec).items():
        if path.read_text() != text:
            path.write_text(text)
            print(f"tables: wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
