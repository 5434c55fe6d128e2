"""Every ``@triton.jit`` function under kernels/ stays small enough to read: at most MAX_LINES
lines and MAX_CONSTEXPRS ``tl.constexpr`` parameters (issue 50: a new code width or layout is a
helper, or a specialised kernel sharing helpers, not one more branch and flag of one kernel).
Parses the sources (no triton import, no kernel run)."""

from __future__ import annotations

import ast
from pathlib import Path

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
MAX_LINES = 350
MAX_CONSTEXPRS = 20


def _is_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(target, ast.Attribute) and target.attr == "jit" or (
        isinstance(target, ast.Name) and target.id == "jit")


def _is_constexpr(arg: ast.arg) -> bool:
    a = arg.annotation
    return a is not None and ((isinstance(a, ast.Attribute) and a.attr == "constexpr")
                              or (isinstance(a, ast.Name) and a.id == "constexpr"))


def jit_functions():
    """(file, name, lines from ``def`` to the last line, constexpr parameters) of each @triton.jit function."""
    for path in sorted(KERNELS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and any(_is_jit(d) for d in node.decorator_list):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                yield (path.relative_to(KERNELS.parent).as_posix(), node.name, node.end_lineno - node.lineno + 1,
                       sum(map(_is_constexpr, args)))


def test_jit_functions_are_small():
    found = list(jit_functions())
    assert any(name == "_decode_split_kernel" for _, name, _, _ in found)  # the parse sees the kernels
    big = [f"{path}::{name}: {lines} lines, {consts} constexpr parameters" for path, name, lines, consts in found
           if lines > MAX_LINES or consts > MAX_CONSTEXPRS]
    assert not big, (f"@triton.jit functions over {MAX_LINES} lines or {MAX_CONSTEXPRS} constexpr parameters "
                     "(move a path into a helper or a specialised kernel):\n" + "\n".join(big))
