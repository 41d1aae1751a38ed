"""What an expression reads and what it computes: the libcst helpers of the knob finder (knobs.py)."""

from __future__ import annotations


def elements(expr) -> list:
    """The values an expression can be: a tuple's items, either branch of an `x if c else y`, else itself."""
    import libcst as cst

    if isinstance(expr, (cst.Tuple, cst.List)):
        return [e.value for e in expr.elements if not isinstance(e, (cst.StarredElement,))]
    if isinstance(expr, cst.IfExp):  # `meta_vocab_size if meta_vocab_size is not None else 50304`: either value
        return [*elements(expr.body), *elements(expr.orelse)]
    return [expr]


def identifiers(expr) -> set[str]:
    """Names and attribute names an expression reads (not the functions it calls)."""
    import libcst as cst

    found: set[str] = set()

    class Names(cst.CSTVisitor):
        def visit_Call(self, node):
            for arg in node.args:
                arg.value.visit(self)
            if isinstance(node.func, cst.Attribute):
                node.func.value.visit(self)
            return False

        def visit_Attribute(self, node):
            found.add(node.attr.value)
            return False

        def visit_Name(self, node):
            found.add(node.value)

        def visit_Subscript(self, node):
            return False  # x.shape[0], cfg["h"]: not a constant's own value

    expr.visit(Names())
    return found


def evaluate(expr, constants: dict[str, int]) -> int | None:
    """Its integer value from literals and known constants (+, -, *, //); None when not computable."""
    import libcst as cst

    if isinstance(expr, cst.Integer):
        value = expr.evaluated_value
        return value if isinstance(value, int) else None
    if isinstance(expr, cst.Name):
        return constants.get(expr.value)
    if isinstance(expr, cst.Attribute):
        return constants.get(expr.attr.value)
    if isinstance(expr, cst.BinaryOperation):
        left, right = evaluate(expr.left, constants), evaluate(expr.right, constants)
        if left is None or right is None:
            return None
        op = type(expr.operator).__name__
        if op == "Add":
            return left + right
        if op == "Subtract":
            return left - right
        if op == "Multiply":
            return left * right
        if op == "FloorDivide" and right:
            return left // right
    return None
