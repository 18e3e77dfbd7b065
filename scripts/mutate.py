"""Mutation check: plant bugs one at a time in a copy of the tree and run the tests that should catch each.

    python scripts/mutate.py --list                       # the sample: id, area, file:line, mutation, tests
    python scripts/mutate.py --budget-min 30              # run it (resumable), then the report
    python scripts/mutate.py --report                     # the report of what the results file holds
    python scripts/mutate.py --hand                       # the hand-written list (scripts/mutants.py)

Two sources of mutants share one runner:

- **the sample** (default): every mutation the generator finds in the files of each *area* (``AREAS``), drawn with
  a fixed seed, ``--per-area`` per area (25: 200 in all), round-robin over the mutation *kinds* so each area gets
  every kind it has. The kinds, generated from Python's ``ast``:
  operators (``+``/``-``, ``*``/``//``, ``<``/``<=``, ``==``/``!=``, ``is``/``is not``, ``in``/``not in``,
  ``and``/``or``, augmented assignments, a ``not`` removed), boundaries (an integer constant ``n`` -> ``n+1`` or
  ``n-1``, a ``range`` bound or a slice bound moved by one, ``min``/``max`` swapped), a call statement deleted (a
  collective, a hook added, a buffer written in place), return values (``True``/``False`` flipped, ``return None``,
  a boolean result negated), and two adjacent positional arguments of the same form swapped. Nothing is generated
  inside error messages, logging, f-strings, annotations or decorators. A mutant's id is
  ``file:line:col:kind`` (stable while the file is unchanged); each runs the tests ``TESTS`` maps to its file.
- **the hand list** (``--hand``): ``scripts/mutants.py``'s plausible bugs, each with the tests that must catch it.

``src/``, ``tests/`` and ``pyproject.toml`` are copied once into a temporary folder; each mutant is written into the
copy, its tests run there (``PYTHONPATH`` puts the copy's ``src`` first, spawned ranks inherit it) with ``pytest
-x`` (in processes forked from a warm one that imported torch and diffusers once: :class:`WarmRunner`), and the
copy's file is put back: the working tree is never edited. A mutant is *killed* when its tests fail, *survives*
when they pass; a run that reaches ``--timeout`` is no verdict (on a busy machine the unchanged tests can take that
long) and a rerun runs it again. The test that killed a mutant is then run alone on the unchanged copy, once per
test: one that fails there too (the environment's fault, or flaky) would kill mutants for nothing, so it is
deselected from then on and the mutant runs again. Results are appended to a JSON-lines file (``--results``), one
line per mutant and per such check; a rerun skips what it holds for an unchanged file, so an interrupted or
time-boxed (``--budget-min``) run resumes where it stopped. The mutants run in turns over the areas, so a run cut
short has sampled every area alike.

An *equivalent* mutant changes nothing any test can observe (a default no caller uses, a bound no input reaches):
``scripts/mutate_equivalent.txt`` lists each such id with its reason; a reason starting ``cuda only:`` or ``compile
only:`` marks instead a survivor in code only a CUDA device runs (the CPU suite cannot reach it) or only
``torch.compile`` traces (the warm runner leaves the compile tests out; ``--cold`` runs them). The report gives the
raw kill rate (killed over run), the kill rate over the non-equivalent mutants, the same without those unreachable
ones, and each survivor with its file:line, its mutation and, for a listed one, the reason. A listed equivalent that is killed is
flagged: its reason is wrong.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "src/ditmesh"
RESULTS = ROOT / "bench/results/mutation/sample.jsonl"
EQUIVALENT = Path(__file__).resolve().parent / "mutate_equivalent.txt"
SEED = 35
#: a reason in EQUIVALENT that starts so marks a survivor in code this runner cannot reach (not an equivalent): code
#: only a CUDA device runs (tests/gpu may reach it), or only ``torch.compile``'s tracing (the compile tests, which
#: the warm runner leaves out and ``--cold`` runs)
CUDA_ONLY = ("cuda only:", "compile only:")

# ---- what is mutated, and the tests that must notice ------------------------------------------------------------

#: area -> the files (under src/ditmesh) whose mutants are sampled together
AREAS: dict[str, tuple[str, ...]] = {
    "core": ("parallel/sequence.py", "parallel/tensor.py", "parallel/batch.py", "attention/local.py",
             "attention/ring.py", "attention/ulysses.py", "attention/usp.py", "comm.py", "mesh.py"),
    "cache": ("cache.py", "redundancy.py"),
    "hooks": ("hooks.py",),
    "pipefusion": ("parallel/pipefusion.py",),
    "displaced": ("parallel/displaced.py",),
    "vae": ("parallel/vae.py", "parallel/vae_chunk.py"),
    # the front end (its queue, jobs, batches, replicas' faults, requests' limits, the command's checks); the ranks'
    # loop (worker.py) and the HTTP server's start (server.py) run only under a real server (tests/test_serve.py)
    "serve": ("serve/app.py", "serve/cli.py", "serve/replica.py", "serve/requests.py"),
    "options": ("options.py",),
}

_RING = "tests/test_ring_usp.py"
_ULY = "tests/test_ulysses.py"
_LOCAL = "tests/test_attention_local.py"
_MASKS = "tests/test_attention_masks.py"
_TP = "tests/test_tensor_parallel.py"
_DP = "tests/test_batch_parallel.py"
_LIMITS = "tests/test_limits.py"
_OPTIONS = (_LIMITS, "tests/test_options.py", "tests/test_config_and_cli_errors.py",
            "tests/test_attention8.py::test_eight_bit_options_are_refused_before_any_import",
            "tests/test_pipefusion.py::test_bad_pipefusion_settings_are_refused_in_one_line",
            "tests/test_pipefusion.py::test_a_family_whose_block_lists_pass_different_activations_is_refused",
            "tests/test_pipefusion.py::test_a_family_pipefusion_was_not_built_for_is_refused",
            "tests/test_displaced.py::test_bad_displaced_settings_are_refused_in_one_line",
            "tests/test_displaced.py::test_cuda_graphs_run_with_displaced_but_not_with_pipefusion",
            "tests/test_displaced.py::test_a_family_with_a_token_grid_is_refused")
_JOBS = "tests/test_serve_jobs.py"
_PART_WAY = "tests/test_image_pipelines.py::test_step_cache_counts_steps_from_where_img2img_starts"
_STALE_PART_WAY = "tests/test_image_pipelines.py::test_stale_schemes_count_their_warmup_from_where_img2img_starts"

#: file -> the tests its mutants run, fastest killers first (``pytest -x`` stops at the first failure)
TESTS: dict[str, tuple[str, ...]] = {
    "parallel/sequence.py": (_RING, _ULY, _MASKS, "tests/test_models_sp.py",
                             "tests/test_allegro.py::test_allegro_pipeline_matches_single_process[ulysses2-uneven]",
                             # ring_gathered: PipeFusion's K/V buffers beside ring
                             "tests/test_pipefusion.py::test_pp2_x_axis2_stale_schedule_matches_its_single_process_"
                             "emulation[ring]",
                             "tests/test_sana.py::test_sana_halo_rows_and_key_sums_matter"),  # a token grid
    "parallel/tensor.py": (_TP,
                           "tests/test_tensor_parallel_models.py::test_sharded_rms_norm_is_exact_and_a_local_norm_is_wrong",
                           "tests/test_tensor_parallel_models.py::test_wan_qk_norm_weights_are_sharded",
                           "tests/test_lora.py::test_flux_lora_tp2_matches_single_process"),
    "parallel/batch.py": (_DP, "tests/test_zimage.py::test_zimage_pipeline_matches_single_process[dp2-even]"),
    "attention/local.py": (_LOCAL, "tests/test_chunk.py::test_attention_in_query_pieces_equals_whole_with_masks_and_lse",
                           _MASKS, _RING, _ULY),
    "attention/ring.py": (_RING,),
    "attention/ulysses.py": (_ULY,),
    "attention/usp.py": (_RING,),
    "comm.py": ("tests/test_comm.py", _ULY, _RING, _DP, _TP),
    "mesh.py": (_RING, _DP, _TP),
    "cache.py": ("tests/test_cache_edges.py", "tests/test_cache.py", _PART_WAY,
                 "tests/test_pipefusion.py::test_cached_pp_stale_schedule_matches_its_single_process_emulation",
                 "tests/test_chroma.py::test_chroma_cache_decides_as_one_process_under_ulysses"),  # a middle that joins
    "redundancy.py": ("tests/test_cache_edges.py", "tests/test_analyze.py", "tests/test_cache.py"),
    "hooks.py": ("tests/test_family_home.py", _PART_WAY,
                 "tests/test_cogvideox.py::test_cogvideox_steps_are_counted_without_a_scheduler_step_index",
                 "tests/test_batch_parallel.py::test_flux_dp2_one_image_leaves_a_rank_an_empty_chunk_without_a_cache",
                 "tests/test_cache.py"),
    "parallel/pipefusion.py": ("tests/test_pipefusion.py", _STALE_PART_WAY),
    "parallel/displaced.py": ("tests/test_displaced.py", _STALE_PART_WAY),
    "parallel/vae.py": ("tests/test_parallel_vae.py",),
    "parallel/vae_chunk.py": ("tests/test_parallel_vae.py",),
    "serve/app.py": (_JOBS, "tests/test_serve_ray.py::test_a_request_whose_replica_fails_before_its_first_step_runs_again_"
                            "once_else_it_fails_naming_the_fault"),
    "serve/cli.py": (_LIMITS, "tests/test_serve.py::test_serve_refuses_bad_options_in_one_line_and_leaves_no_rank",
                     "tests/test_serve.py::test_openai_and_native_requests_return_the_pictures",
                     "tests/test_options.py::test_generate_and_serve_refuse_an_option_before_torch_loads"),
    "serve/replica.py": (_JOBS,),
    "serve/requests.py": (_LIMITS, _JOBS),
    "options.py": _OPTIONS,
}


@dataclass(frozen=True)
class Mutant:
    """One planted bug: bytes ``start:end`` of ``PACKAGE/file`` (``old``) become ``new``; or, for a hand-listed
    mutant (``start`` < 0), every one of the ``count`` occurrences of ``old``."""

    id: str
    area: str
    file: str
    line: int
    kind: str
    old: str
    new: str
    tests: tuple[str, ...]
    start: int = -1
    end: int = -1
    count: int = 1
    #: hand list: why no test can observe it (must survive); the sample's equivalents are in EQUIVALENT
    equivalent: str = ""
    bug: str = ""

    def apply(self, source: str) -> str:
        if self.start < 0:
            return source.replace(self.old, self.new)
        data = source.encode()
        return (data[:self.start] + self.new.encode() + data[self.end:]).decode()

    def describe(self) -> str:
        if self.bug:
            return self.bug
        return f"{_short(self.old)} -> {_short(self.new)}"


def _short(text: str, width: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


# ---- the generator ----------------------------------------------------------------------------------------------

_SWAP_BINOP = {ast.Add: "-", ast.Sub: "+", ast.Mult: "//", ast.FloorDiv: "*", ast.Div: "*", ast.Mod: "//",
               ast.LShift: ">>", ast.RShift: "<<", ast.BitAnd: "|", ast.BitOr: "&"}
_BINOP_TEXT = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.FloorDiv: "//", ast.Div: "/", ast.Mod: "%",
               ast.LShift: "<<", ast.RShift: ">>", ast.BitAnd: "&", ast.BitOr: "|"}
_SWAP_CMP = {ast.Lt: ("<", "<="), ast.LtE: ("<=", "<"), ast.Gt: (">", ">="), ast.GtE: (">=", ">"),
             ast.Eq: ("==", "!="), ast.NotEq: ("!=", "=="), ast.Is: ("is", "is not"), ast.IsNot: ("is not", "is"),
             ast.In: ("in", "not in"), ast.NotIn: ("not in", "in")}
_AUG = {ast.Add: ("+=", "-="), ast.Sub: ("-=", "+="), ast.Mult: ("*=", "//="), ast.FloorDiv: ("//=", "*="),
        ast.Div: ("/=", "*="), ast.BitOr: ("|=", "&="), ast.BitAnd: ("&=", "|=")}
#: calls whose arguments are messages, not behaviour
_QUIET = re.compile(r"^(log|logger|_log|LOG|warnings|logging)\.|^(print|warn)$")


def _call_name(node: ast.Call) -> str:
    try:
        return ast.unparse(node.func)
    except Exception:  # noqa: BLE001 - an odd callee is just not quiet
        return ""


class _Generator(ast.NodeVisitor):
    """Every candidate mutation of one file, as (kind, node-ish span, old text, new text)."""

    def __init__(self, source: str, rel: str, area: str):
        self.source, self.rel, self.area = source, rel, area
        self.data = source.encode()
        lines = self.data.splitlines(keepends=True)
        self.line_start = [0]
        for line in lines:
            self.line_start.append(self.line_start[-1] + len(line))
        self.found: list[Mutant] = []
        self.docstrings = set()

    # -- spans ---
    def offset(self, line: int, col: int) -> int:
        return self.line_start[line - 1] + col

    def span(self, node) -> tuple[int, int]:
        return self.offset(node.lineno, node.col_offset), self.offset(node.end_lineno, node.end_col_offset)

    def text(self, start: int, end: int) -> str:
        return self.data[start:end].decode()

    def add(self, kind: str, line: int, col: int, start: int, end: int, new: str, tag: str = "") -> None:
        old = self.text(start, end)
        if old == new:
            return
        ident = f"{self.rel}:{line}:{col}:{kind}{tag}"
        self.found.append(Mutant(ident, self.area, self.rel, line, kind, old, new, TESTS[self.rel], start, end))

    def gap_op(self, kind, left, right, before: str, after: str, node, tag="") -> None:
        """Replace the operator text ``before`` by ``after`` in the source between ``left`` and ``right``."""
        start, end = self.span(left)[1], self.span(right)[0]
        gap = self.text(start, end)
        pattern = r"\s+".join(re.escape(word) for word in before.split())
        if before[0].isalpha():
            pattern = rf"\b{pattern}\b"
        match = None
        for m in re.finditer(pattern, gap):
            match = m  # the first: a gap like ") - (" holds the operator and parentheses only
            break
        if match is None:
            return
        a, b = start + len(gap[:match.start()].encode()), start + len(gap[:match.end()].encode())
        self.add(kind, node.lineno, node.col_offset, a, b, after, tag)

    # -- what is skipped ---
    def generic_visit(self, node):
        super().generic_visit(node)

    def visit_JoinedStr(self, node):  # f-strings: messages
        return

    def visit_Raise(self, node):  # the message; the condition that raises is in the enclosing if
        return

    def visit_Assert(self, node):
        self.visit(node.test)

    def visit_Expr(self, node):
        if isinstance(node.value, ast.Constant):  # docstrings
            return
        if isinstance(node.value, ast.Call):
            name = _call_name(node.value)
            if _QUIET.search(name):
                return
            start, end = self.span(node)
            self.add("delete-call", node.lineno, node.col_offset, start, end, "pass")
        self.generic_visit(node)

    def visit_Call(self, node):
        name = _call_name(node)
        if _QUIET.search(name):
            return
        if name in ("isinstance", "issubclass", "getattr", "hasattr", "setattr"):
            self.generic_visit(node)
            return
        if name in ("min", "max") and len(node.args) >= 2:
            start, end = self.span(node.func)
            self.add("min-max", node.lineno, node.col_offset, start, end, "max" if name == "min" else "min")
        if name == "range" and node.args and not node.keywords:
            stop = node.args[0] if len(node.args) == 1 else node.args[1]
            start, end = self.span(stop)
            text = self.text(start, end)
            self.add("range", node.lineno, node.col_offset, start, end, f"({text}) - 1", "-stop-1")
            self.add("range", node.lineno, node.col_offset, start, end, f"({text}) + 1", "-stop+1")
            if len(node.args) >= 2:
                start, end = self.span(node.args[0])
                self.add("range", node.lineno, node.col_offset, start, end, f"({self.text(start, end)}) + 1",
                         "-start+1")
        positional = [a for a in node.args if not isinstance(a, ast.Starred)]
        if len(positional) == len(node.args):
            for i, (a, b) in enumerate(zip(positional, positional[1:])):
                if _same_form(a, b):
                    (sa, ea), (sb, eb) = self.span(a), self.span(b)
                    ta, tb = self.text(sa, ea), self.text(sb, eb)
                    if ta != tb:
                        gap = self.text(ea, sb)
                        self.add("swap-args", node.lineno, node.col_offset, sa, eb, tb + gap + ta, f"-{i}")
        self.generic_visit(node)

    def visit_FunctionDef(self, node):
        for default in node.args.defaults + [d for d in node.args.kw_defaults if d is not None]:
            self.visit(default)
        for stmt in node.body:
            self.visit(stmt)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        for stmt in node.body:
            self.visit(stmt)

    def visit_AnnAssign(self, node):
        if node.value is not None:
            self.visit(node.value)

    def visit_If(self, node):
        if _type_checking(node.test):
            return
        self.generic_visit(node)

    # -- mutations ---
    def visit_BinOp(self, node):
        swap = _SWAP_BINOP.get(type(node.op))
        strings = any(isinstance(side, (ast.JoinedStr, ast.Constant)) and isinstance(getattr(side, "value", ""), str)
                      for side in (node.left, node.right))
        if swap and not strings:
            self.gap_op("operator", node.left, node.right, _BINOP_TEXT[type(node.op)], swap, node)
        self.generic_visit(node)

    def visit_Compare(self, node):
        left = node.left
        for i, (op, right) in enumerate(zip(node.ops, node.comparators)):
            before, after = _SWAP_CMP[type(op)]
            self.gap_op("compare", left, right, before, after, node, f"-{i}" if len(node.ops) > 1 else "")
            left = right
        self.generic_visit(node)

    def visit_BoolOp(self, node):
        before, after = ("and", "or") if isinstance(node.op, ast.And) else ("or", "and")
        start, end = self.span(node)
        text = self.text(start, end)
        pieces, last = [], start
        for left, right in zip(node.values, node.values[1:]):
            a, b = self.span(left)[1], self.span(right)[0]
            gap = self.text(a, b)
            pieces.append(self.text(last, a) + re.sub(rf"\b{before}\b", after, gap, count=1))
            last = b
        new = "".join(pieces) + self.text(last, end)
        if new != text:
            self.add("boolop", node.lineno, node.col_offset, start, end, new)
        self.generic_visit(node)

    def visit_UnaryOp(self, node):
        if isinstance(node.op, ast.Not):
            start, end = self.span(node)
            inner = self.span(node.operand)
            self.add("not-removed", node.lineno, node.col_offset, start, end, f"({self.text(*inner)})")
        elif isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            pass  # -1 is a constant: the constant's own mutation moves it
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        pair = _AUG.get(type(node.op))
        if pair:
            self.gap_op("augassign", node.target, node.value, pair[0], pair[1], node)
        self.generic_visit(node)

    def visit_Constant(self, node):
        value = node.value
        start, end = self.span(node)
        if isinstance(value, bool):
            self.add("bool", node.lineno, node.col_offset, start, end, str(not value))
        elif isinstance(value, int):
            self.add("constant", node.lineno, node.col_offset, start, end, str(value + 1), "+1")
            self.add("constant", node.lineno, node.col_offset, start, end, str(value - 1), "-1")

    def visit_Subscript(self, node):
        if isinstance(node.slice, ast.Slice):
            for which, bound in (("lower", node.slice.lower), ("upper", node.slice.upper)):
                if bound is None:
                    continue
                start, end = self.span(bound)
                text = self.text(start, end)
                self.add("slice", node.lineno, node.col_offset, start, end, f"({text}) + 1", f"-{which}+1")
                self.add("slice", node.lineno, node.col_offset, start, end, f"({text}) - 1", f"-{which}-1")
        self.generic_visit(node)

    def visit_Return(self, node):
        value = node.value
        if value is None or (isinstance(value, ast.Constant) and value.value is None):
            return
        start, end = self.span(value)
        if not (isinstance(value, ast.Constant) and isinstance(value.value, bool)):
            self.add("return", node.lineno, node.col_offset, start, end, "None", "-none")
        if isinstance(value, (ast.Compare, ast.BoolOp)) or (isinstance(value, ast.UnaryOp)
                                                             and isinstance(value.op, ast.Not)):
            self.add("return", node.lineno, node.col_offset, start, end, f"not ({self.text(start, end)})", "-not")
        self.generic_visit(node)


def _same_form(a, b) -> bool:
    """Two arguments that could be swapped without a type error a glance would see: both names of values (not
    classes or builtins), both attributes, both subscripts, or constants of one type."""
    if isinstance(a, ast.Constant) and isinstance(b, ast.Constant):
        return type(a.value) is type(b.value) and not isinstance(a.value, str)
    if isinstance(a, ast.Name) and isinstance(b, ast.Name):
        return not any(n.id[0].isupper() or hasattr(builtins, n.id) for n in (a, b))
    return type(a) is type(b) and isinstance(a, (ast.Attribute, ast.Subscript))


def _type_checking(test) -> bool:
    return isinstance(test, (ast.Name, ast.Attribute)) and ast.unparse(test).endswith("TYPE_CHECKING")


def candidates(area: str, rel: str, root: Path = ROOT) -> list[Mutant]:
    """Every mutation the generator finds in ``PACKAGE/rel``, in source order (:func:`parses` tells which of them
    still parse)."""
    source = (root / PACKAGE / rel).read_text()
    gen = _Generator(source, rel, area)
    gen.visit(ast.parse(source))
    unique = {m.id: m for m in gen.found}
    return sorted(unique.values(), key=lambda m: (m.start, m.id))


def parses(m: Mutant, root: Path = ROOT) -> bool:
    try:
        ast.parse(m.apply((root / PACKAGE / m.file).read_text()))
    except SyntaxError:
        return False
    return True


def sample(per_area: int, seed: int = SEED, areas=None, root: Path = ROOT) -> list[Mutant]:
    """``per_area`` mutants of each area, drawn with ``seed``: the kinds in a seeded order, one of each in turn
    (each kind's mutants shuffled), so an area gets every kind it has before any kind twice. Each area draws from
    its own generator: a change in one area's files leaves the others' samples as they were."""
    chosen = []
    for area in areas or AREAS:
        rng = random.Random(f"{seed}:{area}")
        by_kind: dict[str, list[Mutant]] = defaultdict(list)
        for rel in AREAS[area]:
            for m in candidates(area, rel, root):
                by_kind[m.kind].append(m)
        kinds = sorted(by_kind)
        rng.shuffle(kinds)
        for kind in kinds:
            rng.shuffle(by_kind[kind])
        picked = []
        while len(picked) < per_area and any(by_kind.values()):
            for kind in kinds:
                while by_kind[kind] and len(picked) < per_area:
                    m = by_kind[kind].pop()
                    if parses(m, root):
                        picked.append(m)
                        break
        chosen += sorted(picked, key=lambda m: (m.file, m.start))
    return chosen


def hand_list() -> list[Mutant]:
    """scripts/mutants.py's list, as mutants of this runner (its snippets checked first)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import mutants as hand  # noqa: PLC0415 - a sibling script, imported only for --hand

    hand.check_snippets(hand.MUTANTS)
    out = []
    for m in hand.MUTANTS:
        source = (ROOT / PACKAGE / m.file).read_text()
        line = source[:source.index(m.old)].count("\n") + 1
        out.append(Mutant(m.id, "hand", m.file, line, "hand", m.old, m.new, m.tests, count=m.count,
                          equivalent=m.equivalent, bug=m.bug))
    return out


# ---- running ----------------------------------------------------------------------------------------------------

def copy_env(copy: Path, **extra) -> dict:
    """The environment that makes Python (and every process it spawns) import ditmesh from ``copy``."""
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **extra,
                PYTHONPATH=os.pathsep.join(p for p in (str(copy / "src"), os.environ.get("PYTHONPATH")) if p))


def _pytest_args(tests) -> list[str]:
    return ["-q", "-x", "-p", "no:cacheprovider", *tests]


def run_tests(tests, copy: Path, timeout_s: float, collective_timeout_s: float) -> tuple[str, float, str]:
    """Run pytest on ``tests`` in the copy, in a fresh interpreter: (outcome, seconds, output); outcome ``failed`` (a
    test failed), ``passed``, ``timeout`` or ``error`` (pytest could not collect or run them)."""
    env = copy_env(copy, DITMESH_TEST_TIMEOUT_S=str(collective_timeout_s))
    cmd = [sys.executable, "-m", "pytest", *_pytest_args(tests)]
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=copy, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # its own process group: the ranks go with it on a timeout
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", time.monotonic() - start, out
    return _OUTCOMES.get(proc.returncode, "error"), time.monotonic() - start, out


_OUTCOMES = {0: "passed", 1: "failed"}

#: the warm runner's process: imports what every test process imports (not ditmesh), then forks a pytest per line
#: of JSON it reads ({args, cwd, env, log, timeout}) and answers each with {rc} (None: timed out)
_WARM = r"""
import json, os, signal, sys, time
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"  # no thread pool: forking stays safe
import torch, torch.distributed, diffusers, transformers, pytest  # noqa: E401,F401
torch.set_num_threads(1)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.setsid()  # its own process group: its ranks and servers go with it
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.chdir(job["cwd"])
        os.environ.clear()
        os.environ.update(job["env"])
        sys.path[:0] = [p for p in job["env"]["PYTHONPATH"].split(os.pathsep) if p not in sys.path]
        rc = 3
        try:
            rc = int(pytest.main(job["args"]))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(rc)
    deadline = time.monotonic() + job["timeout"]
    rc = None
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            rc = os.waitstatus_to_exitcode(status)
            break
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    try:
        os.killpg(pid, signal.SIGKILL)  # what the tests left running, or all of it on a timeout
    except ProcessLookupError:
        pass
    if rc is None:
        os.waitpid(pid, 0)
    print(json.dumps({"rc": rc}), flush=True)
"""


class WarmRunner:
    """Runs pytest in processes forked from one that imported torch, diffusers and transformers once (their
    gloo workers fork from the test process: ``DITMESH_TEST_START=fork``), instead of a fresh interpreter per
    mutant whose worker server imports them again: seconds instead of tens of seconds per mutant on a busy
    machine. ditmesh itself is imported by each test process, from the copy. ``torch.compile`` does not run in
    such a forked process: the tests whose names say ``compile`` are left out (``--cold`` runs them)."""

    def __init__(self, copy: Path):
        self.copy = copy
        self.proc = subprocess.Popen([sys.executable, "-c", _WARM], cwd=copy, env=copy_env(copy), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        line = self.proc.stdout.readline()
        if not line.startswith('{"ready"'):
            sys.exit("mutate: the warm runner did not start (run with --cold to see why)")

    def __call__(self, tests, copy: Path, timeout_s: float, collective_timeout_s: float) -> tuple[str, float, str]:
        tests = [*tests, "-k", "not compile"]  # torch.compile fails in a forked process: --cold runs those tests
        env = copy_env(copy, DITMESH_TEST_TIMEOUT_S=str(collective_timeout_s), DITMESH_TEST_START="fork",
                       OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        log = copy / "pytest.log"
        start = time.monotonic()
        self.proc.stdin.write(json.dumps({"args": _pytest_args(tests), "cwd": str(copy), "env": env, "log": str(log),
                                          "timeout": timeout_s}) + "\n")
        self.proc.stdin.flush()
        rc = json.loads(self.proc.stdout.readline())["rc"]
        out = log.read_text(errors="replace") if log.exists() else ""
        outcome = "timeout" if rc is None else _OUTCOMES.get(rc, "error")
        return outcome, time.monotonic() - start, out

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


def file_sha(rel: str, root: Path = ROOT) -> str:
    return hashlib.sha1((root / PACKAGE / rel).read_bytes()).hexdigest()[:12]


def tests_sha(tests, root: Path = ROOT) -> str:
    digest = hashlib.sha1()
    for path in sorted({t.split("::")[0] for t in tests}):
        digest.update((root / path).read_bytes())
    return digest.hexdigest()[:12]


def load_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill: that mutant runs again
                continue
    return rows


def load_equivalent(path: Path = EQUIVALENT) -> dict[str, str]:
    """id -> reason, from lines ``ID  REASON`` (``#`` starts a comment line)."""
    out = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                ident, _, reason = line.strip().partition(" ")
                out[ident] = reason.strip()
    return out


def _done(rows: list[dict]) -> tuple[dict, dict]:
    """(mutant results by (id, file sha), checks of single tests on the unchanged tree by (node, test file sha)),
    the last of each."""
    mutants, checks = {}, {}
    for row in rows:
        if row.get("type") == "check":
            checks[(row["node"], row["tests_sha"])] = row
        elif "id" in row:
            mutants[(row["id"], row["sha"])] = row
    return mutants, checks


def _first_failure(text: str) -> str | None:
    """The node id (or file, for a collection error) of the first ``FAILED``/``ERROR`` line of pytest's summary
    (``FAILED <node> - <message>``; a node id may hold spaces: ``test_x[{'ring': 2}]``)."""
    for line in text.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return line.split(" ", 1)[1].split(" - ", 1)[0].strip()
    return None


def interleave(mutants: list[Mutant]) -> list[Mutant]:
    """The mutants in turns over the areas (the first of each area, then the second, ...): a run cut short by its
    budget has sampled every area alike."""
    by_area: dict[str, list[Mutant]] = defaultdict(list)
    for m in mutants:
        by_area[m.area].append(m)
    out = []
    for i in range(max(map(len, by_area.values()), default=0)):
        out += [ms[i] for ms in by_area.values() if i < len(ms)]
    return out


def run(mutants: list[Mutant], results: Path, budget_min: float, timeout_s: float, collective_timeout: float,
        cold: bool = False, rerun_survivors: bool = False, reverse: bool = False) -> None:
    """Run the mutants not yet in ``results`` until the budget is spent, appending a line per mutant.

    The test that kills a mutant is run once alone on the unchanged copy (a line ``check`` per test): one that fails
    there too (broken by the environment, or flaky) is deselected from then on and the mutant runs again."""
    results.parent.mkdir(parents=True, exist_ok=True)
    done, checks = _done(load_results(results))
    listed = load_equivalent()  # a listed survivor is not run again: its reason says why no test can kill it

    def again(row: dict) -> bool:  # a run that timed out, or (asked) a survivor not listed
        return row["outcome"] == "timeout" or (rerun_survivors and row["status"] == "survived"
                                               and row["id"] not in listed)

    todo = [m for m in interleave(mutants) if (m.id, file_sha(m.file)) not in done
            or again(done[(m.id, file_sha(m.file))])]
    if reverse:  # a second run on the same results file takes the list from its end
        todo.reverse()
    print(f"{len(mutants) - len(todo)} of {len(mutants)} mutants already in {results}; {len(todo)} to run", flush=True)
    if not todo:
        return
    deadline = time.monotonic() + budget_min * 60
    began = time.time()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    fd = os.open(results, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with tempfile.TemporaryDirectory(prefix="ditmesh-mutate-") as tmp:
        copy = Path(tmp)
        for part in ("src", "tests"):
            shutil.copytree(ROOT / part, copy / part, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        shutil.copy2(ROOT / "pyproject.toml", copy / "pyproject.toml")
        probe = subprocess.run([sys.executable, "-c", "import ditmesh; print(ditmesh.__file__)"], text=True,
                               capture_output=True, cwd=copy, env=copy_env(copy))
        if not probe.stdout.startswith(str(copy)):
            sys.exit(f"mutate: the tests would not import the copy (got {probe.stdout.strip() or probe.stderr})")
        runner = run_tests if cold else WarmRunner(copy)

        def write(row: dict) -> None:
            os.write(fd, (json.dumps(row) + "\n").encode())  # one append: runs sharing the file never interleave

        def passes_unchanged(node: str) -> bool:
            key = (node, tests_sha([node]))
            if key not in checks:
                args = [node] if "::" in node else ["--collect-only", node]
                outcome, seconds, text = runner(args, copy, timeout_s, collective_timeout)
                checks[key] = {"type": "check", "node": node, "tests_sha": key[1], "outcome": outcome,
                               "seconds": round(seconds, 1)}
                if outcome != "passed":
                    checks[key]["tail"] = text[-3000:]
                write(checks[key])
                print(f"  check {node} on the unchanged tree: {outcome} in {seconds:.0f} s", flush=True)
            return checks[key]["outcome"] == "passed"

        for i, m in enumerate(todo, 1):
            if time.monotonic() > deadline:
                print(f"budget of {budget_min:g} min spent: {len(todo) - i + 1} mutants left for a rerun", flush=True)
                break
            now_done, now_checks = _done(load_results(results))  # what another run on this file did meanwhile
            checks.update(now_checks)
            row = now_done.get((m.id, file_sha(m.file)))
            if row is not None and (not again(row) or row.get("at", 0) > began):
                continue
            path = copy / PACKAGE / m.file
            original = path.read_text()
            while True:
                broken = sorted(node for (node, _), c in checks.items() if c["outcome"] != "passed" and "::" in node)
                tests = [*m.tests, *(f"--deselect={node}" for node in broken)]
                path.write_text(m.apply(original))
                try:
                    outcome, seconds, text = runner(tests, copy, timeout_s, collective_timeout)
                finally:
                    path.write_text(original)
                killer = _first_failure(text) if outcome in ("failed", "error") else None
                if killer is None or passes_unchanged(killer):
                    break
                if "::" not in killer:  # a test file that does not even collect unchanged
                    outcome = "error"
                    break
            status = {"failed": "killed", "timeout": "killed", "passed": "survived"}.get(outcome, "error")
            if outcome == "error" and killer is not None and "::" not in killer and checks.get(
                    (killer, tests_sha([killer])), {}).get("outcome") == "passed":
                status = "killed"  # the mutant breaks the import of a test module
            row = {"id": m.id, "area": m.area, "file": m.file, "line": m.line, "kind": m.kind, "old": m.old,
                   "new": m.new, "sha": file_sha(m.file), "tests": list(m.tests), "status": status,
                   "outcome": outcome, "seconds": round(seconds, 1), "deselected": broken, "at": round(time.time())}
            if m.equivalent:
                row["equivalent"] = m.equivalent
            if m.bug:
                row["bug"] = m.bug
            if status == "killed":
                row["killed_by"] = killer
            else:
                row["tail"] = "\n".join(text.strip().splitlines()[-6:])
            write(row)
            print(f"[{i:3d}/{len(todo)}] {status:<8} {seconds:5.0f} s  {m.id}  {m.describe()}", flush=True)
        if not cold:
            runner.close()
    os.close(fd)


# ---- the report -------------------------------------------------------------------------------------------------

def report(mutants: list[Mutant], results: Path, equivalent: dict[str, str], out=sys.stdout) -> dict:
    """Print the numbers and the survivors of ``mutants`` found in ``results``; return the numbers."""
    done, _ = _done(load_results(results))
    rows = [done[(m.id, file_sha(m.file))] for m in mutants if (m.id, file_sha(m.file)) in done]
    rows = [r for r in rows if r["status"] in ("killed", "survived")]
    # a run that hit --timeout is no verdict: on a busy machine the unchanged tests may take that long too
    timed_out = [r for r in rows if r["outcome"] == "timeout"]
    rows = [r for r in rows if r["outcome"] != "timeout"]
    by_area: dict[str, Counter] = defaultdict(Counter)
    survivors, wrong = [], []
    for r in rows:
        reason = r.get("equivalent") or equivalent.get(r["id"], "")
        c = by_area[r["area"]]
        c["run"] += 1
        c["killed"] += r["status"] == "killed"
        cuda = reason.startswith(CUDA_ONLY)
        c["equivalent"] += bool(reason) and not cuda and r["status"] == "survived"
        c["cuda"] += cuda and r["status"] == "survived"
        if r["status"] == "survived":
            survivors.append((r, reason))
        elif reason and not cuda:
            wrong.append(r)
    total = sum(by_area.values(), Counter())
    errors = sum(1 for m in mutants if (m.id, file_sha(m.file)) in done
                 and done[(m.id, file_sha(m.file))]["status"] == "error")

    def rate(c: Counter) -> str:
        raw = f"{c['killed']}/{c['run']} ({100 * c['killed'] / c['run']:.0f}%)" if c["run"] else "-"
        live = c["run"] - c["equivalent"]
        real = f"{c['killed']}/{live} ({100 * c['killed'] / live:.1f}%)" if live else "-"
        cpu = live - c["cuda"]
        on_cpu = f"{c['killed']}/{cpu} ({100 * c['killed'] / cpu:.1f}%)" if cpu else "-"
        return (f"raw {raw:<15} non-equivalent {real:<17} equivalent {c['equivalent']:<3} "
                f"CUDA/compile-only {c['cuda']:<3} reachable non-equivalent {on_cpu}")

    print(f"{len(rows)} of {len(mutants)} mutants run to a verdict ({errors} could not run, {len(timed_out)} timed out: "
          "run them again with a longer --timeout)", file=out)
    for area in sorted(by_area, key=list(AREAS).index if all(a in AREAS for a in by_area) else str):
        print(f"  {area:<11} {rate(by_area[area])}", file=out)
    print(f"  {'all':<11} {rate(total)}", file=out)
    if survivors:
        print("survivors:", file=out)
        for r, reason in sorted(survivors, key=lambda x: (bool(x[1]), x[0]["file"], x[0]["line"])):
            print(f"  {PACKAGE}/{r['file']}:{r['line']}  [{r['kind']}] {_short(r['old'], 60)} -> "
                  f"{_short(r['new'], 60)}" + (f"\n      {'' if reason.startswith(CUDA_ONLY) else 'equivalent: '}{reason}" if reason
                     else "  (a missing test)"),
                  file=out)
    for r in timed_out:
        print(f"  timed out after {r['seconds']:.0f} s: {PACKAGE}/{r['file']}:{r['line']}  [{r['kind']}] "
              f"{_short(r['old'], 60)} -> {_short(r['new'], 60)}", file=out)
    for r in wrong:
        print(f"  KILLED but listed equivalent: {r['id']} ({r.get('killed_by')}): fix its reason", file=out)
    return {"run": total["run"], "killed": total["killed"], "equivalent": total["equivalent"], "wrong": len(wrong),
            "cuda": total["cuda"],
            "sampled": len(mutants), "areas": {a: dict(c) for a, c in by_area.items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the mutants and exit")
    parser.add_argument("--report", action="store_true", help="print the report of the results file and exit")
    parser.add_argument("--hand", action="store_true", help="run scripts/mutants.py's hand-written list instead")
    parser.add_argument("--per-area", type=int, default=25, help="mutants sampled per area (default 25)")
    parser.add_argument("--seed", type=int, default=SEED, help=f"the sample's seed (default {SEED})")
    parser.add_argument("--area", default="", help="comma-separated areas to sample (default: all)")
    parser.add_argument("--only", default="", help="comma-separated mutant ids (of the sample, or --hand's)")
    parser.add_argument("--results", type=Path, default=None,
                        help="JSON-lines results file (default bench/results/mutation/sample.jsonl, "
                             "hand.jsonl with --hand)")
    parser.add_argument("--budget-min", type=float, default=60.0, help="stop starting mutants after this (default 60)")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds one run of a mutant's tests may take; more kills it (default 600)")
    parser.add_argument("--rerun-survivors", action="store_true",
                        help="run the survivors in the results file again (after adding tests)")
    parser.add_argument("--reverse", action="store_true",
                        help="take the mutants from the end of the list: a second run on the same results file "
                             "(each skips what the other wrote)")
    parser.add_argument("--collective-timeout", type=float, default=60.0,
                        help="seconds a rank waits in one collective (default 60)")
    parser.add_argument("--cold", action="store_true",
                        help="a fresh interpreter per run of the tests instead of the warm runner's forks")
    args = parser.parse_args(argv)
    areas = [a for a in args.area.split(",") if a] or None
    unknown = [a for a in areas or () if a not in AREAS]
    if unknown:
        parser.error(f"unknown area(s) {', '.join(unknown)}; use some of {', '.join(AREAS)}")
    if args.per_area < 1:
        parser.error(f"--per-area {args.per_area}: give at least 1")
    mutants = hand_list() if args.hand else sample(args.per_area, args.seed, areas)
    results = args.results or RESULTS.with_name("hand.jsonl" if args.hand else "sample.jsonl")
    if args.only:
        wanted = args.only.split(",")
        missing = [w for w in wanted if w not in {m.id for m in mutants}]
        if missing:
            parser.error(f"not in the sample: {', '.join(missing)}; see --list")
        mutants = [m for m in mutants if m.id in wanted]
    if args.list:
        for m in mutants:
            print(f"{m.id}  [{m.area}] {PACKAGE}/{m.file}:{m.line}  {m.describe()}")
        kinds = Counter(m.kind for m in mutants)
        print(f"{len(mutants)} mutants; " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
        return 0
    if not args.report:
        run(mutants, results, args.budget_min, args.timeout, args.collective_timeout, args.cold, args.rerun_survivors,
            args.reverse)
    numbers = report(mutants, results, load_equivalent())
    live = numbers["run"] - numbers["equivalent"]
    print(f"resume: python scripts/mutate.py{' --hand' if args.hand else ''} --budget-min MINUTES"
          + (f" --per-area {args.per_area}" if args.per_area != 25 else "")
          + (f" --seed {args.seed}" if args.seed != SEED else ""))
    if args.hand:  # every listed bug killed, every listed equivalent alive
        return 0 if numbers["run"] == len(mutants) and numbers["killed"] == live and not numbers["wrong"] else 1
    return 0 if live and numbers["killed"] >= 0.9 * live else 1


if __name__ == "__main__":
    raise SystemExit(main())
