"""Structured equality of two MATH answers, without math-verify.

``structured_equal(pred, truth)`` reads each answer as a list of items (top-level commas, ``\\text{and}``,
``\\quad``, "and"/"or") and compares

- lists order-free (``1, 2, 3`` = ``3, 2, 1``), ``\\{...\\}`` sets order-free, a ``(a, b)`` tuple in order
  (a tuple equals the bare list ``a, b`` in the same order), intervals with their brackets (``[0,1)`` is not
  ``[0,1]``), matrices entry by entry (``pmatrix`` = ``bmatrix`` = ``array``);
- ``a \\pm b`` as the two items ``a + b``, ``a - b``;
- ``x = 5`` / ``f(x) = 5`` / ``(p,q) = (3,2)`` by their right side when the left side is a name (no digits
  or operators); ``x \\approx 11`` likewise; ``x \\in S`` as ``S``; ``a < x < b`` as the interval ``(a, b)``;
- equations and inequalities as relations: ``lhs - rhs`` of one is a constant multiple of the other's
  (positive for inequalities, after turning ``>`` into ``<``), so ``5 \\geq x`` = ``x \\leq 5`` and
  ``2x+4y-3=0`` = ``y=-\\frac{1}{2}x+\\frac{3}{4}``;
- single values with ``normalize_answer`` and exact fractions first; then as sympy expressions (a small
  LaTeX reader, below), equal when they agree at a few random points to 60 digits; a decimal with 10 or
  more significant digits may stand for an irrational value and then needs to agree to one unit in its
  last digit (``0.333333`` is not ``\\frac{1}{3}``, ``1.41421356237`` is ``\\sqrt{2}``).

Returns True / False when it can decide, None when an item is outside what it reads (the caller may then
ask math-verify). Numbers with a base subscript (``204_5``) compare as strings only.
"""

from __future__ import annotations

import random
import re
from fractions import Fraction
from typing import Any

__all__ = [
    "approximation_unit", "expand_items", "numbers_close", "structured_equal", "to_sympy", "value_equal",
]

_REL_OPS = {"\\geqslant": ">=", "\\leqslant": "<=", "\\geq": ">=", "\\leq": "<=", "\\ge": ">=", "\\le": "<=",
            "\\neq": "!=", "\\ne": "!=", "\\lt": "<", "\\gt": ">", "≥": ">=", "≤": "<=", "≠": "!="}
_OPEN, _CLOSE = "([{", ")]}"
_NAME_BRACES = re.compile(r"_\{(\w)\}")
_NAME_SUB = re.compile(r"_\{[^{}]*\}|_[A-Za-z0-9]")
_BASE_NUMBER = re.compile(r"\d_\{?\d")
_CONNECTOR = re.compile(r"\\text\{\s*(?:and|or)\s*\}|\\q?quad|(?<![A-Za-z\\])(?:and|or)(?![A-Za-z])")
_WRAPPERS = re.compile(
    r"\\(?:text|textbf|textrm|textnormal|mathrm|mathbf|mathit|mathcal|mbox|operatorname)\s*\{([^{}]*)\}"
)
_MATRIX = re.compile(r"^\\begin\{([pbvB]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}$", re.S)
_TOWER = re.compile(r"\*\*\s*(?:\([^()]*\*\*|[\w.]+\s*\*\*)")
_HUGE = re.compile(r"\d{4,}\s*!|\*\*\s*\(?\s*\d{4,}")
_SAFE = re.compile(r"^[0-9A-Za-z+\-*/().! ]*$")
_FUNCS = ("arcsin", "arccos", "arctan", "sinh", "cosh", "tanh", "sin", "cos", "tan", "sec", "csc", "cot",
          "ln", "log", "exp")
_ALLOWED_NAMES = set(_FUNCS) | {"sqrt", "pi", "oo", "factorial", "Abs", "root"}
MAX_SYMPY_CHARS = 200  # longer items are compared as strings only (bounded time)


def _prepare(answer: str) -> str:
    """Spelling-level clean-up that keeps spaces (they separate tokens such as ``\\sin b``)."""
    s = answer.strip().replace("\n", " ")
    if "\\begin" not in s:  # "\\frac" from a doubly escaped string: not a line break outside matrices
        s = re.sub(r"(?<!\\)\\\\(?=[A-Za-z])", r"\\", s)
    s = s.replace("$", "").replace("\\!", "").replace("{,}", ",")
    s = re.sub(r"\\[dtc]frac", r"\\frac", s)
    s = re.sub(r"\\left\s*|\\right\s*", "", s).replace("\\big", "")
    s = s.replace("\\{", "\x01").replace("\\}", "\x02")  # set braces: kept apart from grouping braces
    while _WRAPPERS.search(s):
        s = _WRAPPERS.sub(r"\1", s)
    s = _CONNECTOR.sub(",", s).replace(";", ",")
    for latex, op in _REL_OPS.items():
        s = re.sub(re.escape(latex) + r"(?![A-Za-z])", op, s)
    s = re.sub(r"(?<!\\)\\[,:; ]", " ", s)
    s = s.strip().rstrip(".").strip()
    compact = s.replace(" ", "")
    if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?", compact) and ", " not in s:
        s = compact.replace(",", "")  # 1,000 is a number; "32, 349" stays a list
    elif re.fullmatch(r"\d{1,3}(?: \d{3})+", s):
        s = compact
    return s


def _split_top(s: str, sep: str = ",") -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in _OPEN or ch == "\x01":
            depth += 1
        elif ch in _CLOSE or ch == "\x02":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts]


def _wrapped(s: str) -> bool:
    """True when the first bracket of ``s`` closes at its last character."""
    depth = 0
    for i, ch in enumerate(s):
        depth += (ch in _OPEN) - (ch in _CLOSE)
        if depth == 0:
            return i == len(s) - 1
    return False


def _is_name(s: str) -> bool:
    """``x``, ``f(x)``, ``(p,q)``, ``|AB|``, ``S_{MBCN}:S``, ``\\frac{NO}{BO}``: no digits, no operators."""
    core = _NAME_SUB.sub("", s.replace(" ", ""))
    if not core or len(core) > 24 or re.search(r"[\d+\-*^=<>!]", core):
        return False
    return bool(re.search(r"[A-Za-z]", core))


def _expand_pm(item: str) -> list[str]:
    if item.count("\\pm") != 1 or item.count("\\mp") or not item.replace("\\pm", "").strip():
        return [item]
    left, right = item.split("\\pm")
    if _split_top(item)[0] != item or "=" in item:
        return [item]
    return [f"{left}+{right}".strip(), f"{left}-{right}".strip()]


def expand_items(answer: str) -> list[str]:
    """Top-level items of an answer, with ``\\pm`` expanded and empty items dropped."""
    items = []
    for part in _split_top(_prepare(answer)):
        items.extend(p for p in _expand_pm(part) if p)
    return items


# ("expr", text, equation or None, name or None) | ("rel", op, lhs, rhs) | ("seq", open, close, [Node])
# | ("set", [Node]) | ("union", [Node]) | ("matrix", [[Node]])
Node = tuple


def _node(item: str) -> Node:
    item = item.strip()
    if match := _MATRIX.match(item):
        rows = [r for r in re.split(r"\\\\", match[2]) if r.strip()]
        return ("matrix", [[_node(c) for c in r.split("&")] for r in rows])
    if item.startswith("\x01") and item.endswith("\x02"):
        return ("set", [_node(p) for p in _split_inner(item[1:-1])])
    if item.startswith("{") and item.endswith("}") and _wrapped(item):  # "{1,3}": grouping braces
        inner = _split_inner(item[1:-1])
        return _node(item[1:-1]) if len(inner) == 1 else ("seq", "", "", [_node(p) for p in inner])
    if item[:1] in "([" and item[-1:] in ")]" and _wrapped(item):
        inner = _split_inner(item[1:-1])
        if len(inner) > 1:
            return ("seq", item[0], item[-1], [_node(p) for p in inner])
        if item[0] == "(" or _MATRIX.match(item[1:-1].strip()):
            return _node(item[1:-1])
    if match := re.match(r"(.*?)\\in(?![a-z])(.*)", item):
        if _is_name(match[1]):
            return _union_node(match[2].strip())
    if "\\cup" in item:
        return _union_node(item)
    if "\\approx" in item:
        left, _, right = item.partition("\\approx")
        return _node(right if _is_name(left) else left)
    return _relation_node(item)


def _split_inner(s: str) -> list[str]:
    out = []
    for part in _split_top(s):
        out.extend(p for p in _expand_pm(part) if p)
    return out


def _union_node(s: str) -> Node:
    parts = [p.strip() for p in s.split("\\cup")]
    return ("union", [_node(p) for p in parts]) if len(parts) > 1 else _node(parts[0])


def _relation_node(item: str) -> Node:
    pieces = re.split(r"(<=|>=|!=|<|>|=)", item)
    if len(pieces) == 1:
        return ("expr", item, None, None)
    terms, ops = [p.strip() for p in pieces[0::2]], pieces[1::2]
    if all(op == "=" for op in ops):
        if _is_name(terms[0]) and terms[-1]:
            node = _node(terms[-1])
            name = _NAME_BRACES.sub(r"_\1", terms[0].replace(" ", ""))
            return ("expr", node[1], item if len(terms) == 2 else None, name) if node[0] == "expr" else node
        if len(terms) == 2:
            return ("rel", "=", terms[0], terms[1])
        return ("expr", item, None, None)
    if len(terms) == 3 and ops[0] == ops[1] and ops[0] in ("<", "<=", ">", ">=") and _is_name(terms[1]):
        low, high = (terms[0], terms[2]) if ops[0] in ("<", "<=") else (terms[2], terms[0])
        bracket = ("(", ")") if ops[0] in ("<", ">") else ("[", "]")  # a < x < b is the interval (a, b)
        return ("seq", *bracket, [("expr", low, None, None), ("expr", high, None, None)])
    if len(terms) == 2:
        return ("rel", ops[0], terms[0], terms[1])
    return ("expr", item, None, None)


def structured_equal(pred: str, truth: str) -> bool | None:
    """Answers equal as lists / tuples / intervals / matrices / relations / values; None: cannot tell."""
    a = [_node(i) for i in expand_items(pred)]
    b = [_node(i) for i in expand_items(truth)]
    if not a or not b:
        return None
    if len(a) == 1 and len(b) == 1:
        return _node_equal(a[0], b[0])
    for one, many in ((a, b), (b, a)):  # a tuple against the bare list of its elements, in order
        if len(one) == 1 and one[0][0] == "seq" and one[0][1] == "(" and len(one[0][3]) == len(many):
            return _all_equal(one[0][3], many)
        if len(one) == 1 and one[0][0] == "seq" and one[0][1] == "":  # {1,2,3}: braces only group
            return _multiset_equal(one[0][3], many)
        if len(one) == 1 and one[0][0] == "set":
            return _multiset_equal(one[0][1], many)
    return _multiset_equal(a, b)


def _all_equal(xs: list[Node], ys: list[Node]) -> bool | None:
    if len(xs) != len(ys):
        return False
    results = [_node_equal(x, y) for x, y in zip(xs, ys)]
    if any(r is False for r in results):
        return False
    return None if any(r is None for r in results) else True


def _dedupe(xs: list[Node]) -> list[Node]:
    """Answer lists are sets: a repeated solution counts once."""
    out: list[Node] = []
    for x in xs[:50]:
        if not any(_node_equal(x, y) for y in out):
            out.append(x)
    return out + xs[50:]


def _multiset_equal(xs: list[Node], ys: list[Node]) -> bool | None:
    xs, ys = _dedupe(xs), _dedupe(ys)
    if len(xs) != len(ys):
        return False
    unknown, used = False, [False] * len(ys)
    for x in xs:
        for j, y in enumerate(ys):
            if not used[j]:
                r = _node_equal(x, y)
                if r:
                    used[j] = True
                    break
                unknown |= r is None
        else:
            return None if unknown else False
    return True


def _node_equal(x: Node, y: Node) -> bool | None:
    if x[0] == "expr" and y[0] == "rel" and x[2]:
        x = _relation_node_raw(x[2])
    if y[0] == "expr" and x[0] == "rel" and y[2]:
        y = _relation_node_raw(y[2])
    if x[0] != y[0]:
        if {x[0], y[0]} == {"set", "seq"}:  # {1,3} grouping vs a set
            xs, ys = (x[1] if x[0] == "set" else x[3]), (y[1] if y[0] == "set" else y[3])
            if "" in (x[1:3] if x[0] == "seq" else y[1:3]):
                return _multiset_equal(xs, ys)
        return False
    kind = x[0]
    if kind == "expr":
        if x[3] and y[3] and x[3] != y[3]:  # x=1, y=2 is not x=2, y=1
            return False
        return value_equal(x[1], y[1])
    if kind == "seq":
        if (x[1], x[2]) != (y[1], y[2]) and "" not in (x[1], y[1]):
            return False
        return _all_equal(x[3], y[3])
    if kind in ("set", "union"):
        return _multiset_equal(x[1], y[1])
    if kind == "matrix":
        if len(x[1]) != len(y[1]) or any(len(r) != len(s) for r, s in zip(x[1], y[1])):
            return False
        return _all_equal([c for r in x[1] for c in r], [c for r in y[1] for c in r])
    return _relation_equal(x, y)


def _relation_node_raw(item: str) -> Node:
    lhs, _, rhs = item.partition("=")
    return ("rel", "=", lhs.strip(), rhs.strip())


def _relation_equal(x: Node, y: Node) -> bool | None:
    (_, op1, l1, r1), (_, op2, l2, r2) = x, y
    flip = {">": "<", ">=": "<="}
    d1, d2 = to_sympy(f"({l1})-({r1})"), to_sympy(f"({l2})-({r2})")
    if op1 in flip:
        op1, d1 = flip[op1], None if d1 is None else -d1
    if op2 in flip:
        op2, d2 = flip[op2], None if d2 is None else -d2
    if op1 != op2:
        return False
    if d1 is None or d2 is None:
        return value_equal(f"{l1}{x[1]}{r1}", f"{l2}{y[1]}{r2}") or None
    ratios = [r for r, _ in _sample(d1 / d2, d1.free_symbols | d2.free_symbols)]
    if not ratios:
        return None
    first = ratios[0]
    if any(abs(r - first) > 1e-20 * max(1.0, abs(first)) for r in ratios) or abs(first) < 1e-20:
        return False
    return bool(first.real > 0 and abs(first.imag) < 1e-12) if op1 in ("<", "<=") else True


def value_equal(a: str, b: str) -> bool | None:
    """Two single values: normalised strings, exact fractions, then sympy at random points."""
    # lazy: a cycle, scorers.math imports this module
    from megatron_rl.reward.scorers.math import _as_fraction, normalize_answer  # noqa: PLC0415

    na, nb = normalize_answer(a), normalize_answer(b)
    if na == nb or na.lower() == nb.lower() and na.isalpha():
        return True
    na, nb = _mixed_number(na), _mixed_number(nb)
    fa, fb = _as_fraction(na), _as_fraction(nb)
    if fa is not None and fb is not None:
        return numbers_close(fa, fb, na, nb)
    if _BASE_NUMBER.search(na) or _BASE_NUMBER.search(nb):
        return False if (fa is not None or fb is not None or "_" in na and "_" in nb) else None
    ea, eb = to_sympy(_strip_for_sympy(a)), to_sympy(_strip_for_sympy(b))
    if ea is None or eb is None:
        return None
    samples = _sample(ea - eb, ea.free_symbols | eb.free_symbols, scale=(ea, eb))
    if not samples:
        return None
    last_digit = approximation_unit(a, b)
    if last_digit is not None:  # a long decimal against an exact value: within one unit of its last digit
        return all(abs(diff) <= float(last_digit) * max(1.0, size) for diff, size in samples)
    return all(abs(diff) <= max(1e-30 * size, 1e-50) for diff, size in samples)


_DECIMAL = re.compile(r"\d*\.\d+")
APPROX_DIGITS = 10  # a decimal with this many significant digits may stand for an irrational value


def approximation_unit(*texts: str) -> Fraction | None:
    """One unit in the last place of the longest decimal with >= APPROX_DIGITS significant digits in
    ``texts``; None when there is none (then numbers must be equal exactly)."""
    unit = None
    for text in texts:
        for literal in _DECIMAL.findall(text):
            if len(literal.replace(".", "").lstrip("0")) >= APPROX_DIGITS:
                here = Fraction(1, 10 ** len(literal.split(".")[1]))
                unit = here if unit is None else max(unit, here)
    return unit


def numbers_close(x: Fraction, y: Fraction, text_x: str, text_y: str) -> bool:
    """Equal, or a long decimal within one unit of its last digit of the other value:
    ``0.0833333333333333`` = 1/12, but ``0.333333`` is not 1/3 and 11111111110 is not 11111111100."""
    if x == y:
        return True
    unit = approximation_unit(text_x, text_y)
    return unit is not None and abs(x - y) <= unit


def _mixed_number(s: str) -> str:
    """``3\\frac{1}{2}`` -> ``7/2`` (a digit right before a numeric fraction is a mixed number)."""
    match = re.fullmatch(r"(-?)(\d+)\\frac\{(\d+)\}\{(\d+)\}", s)
    if not match or int(match[4]) == 0:
        return s
    value = int(match[2]) + Fraction(int(match[3]), int(match[4]))
    return f"{match[1]}{value.numerator}/{value.denominator}"


def _strip_for_sympy(s: str) -> str:
    # lazy: a cycle, scorers.math imports this module
    from megatron_rl.reward.scorers.math import _strip_unit  # noqa: PLC0415

    s = _strip_unit(s.strip())
    for token in ("^{\\circ}", "^\\circ", "\\%", "%", "\\$"):
        s = s.replace(token, "")
    return s.rstrip("\\").strip()


def _sample(expr: Any, symbols: set, scale: tuple = ()) -> list[tuple[complex, float]]:
    """(value of ``expr``, largest size of ``scale``'s expressions) at up to 4 random rational points,
    evaluated to 60 digits (exact inputs: an identity leaves only ~1e-58 of noise)."""
    import sympy  # noqa: PLC0415 - only when a string match did not decide

    rng = random.Random(0)
    values = []
    ordered = sorted(symbols, key=str)
    for _ in range(8):
        # both signs, so that sqrt(x^2) is not x
        point = {s: sympy.Rational(rng.choice((-1, 1)) * rng.randint(300, 1700), 1000) for s in ordered}
        try:
            value = complex(expr.subs(point).evalf(60))
            size = max([0.0] + [abs(complex(e.subs(point).evalf(60))) for e in scale])
        except (TypeError, ValueError, ZeroDivisionError, OverflowError, AttributeError):
            continue
        if value != value or abs(value) == float("inf"):
            continue
        values.append((value, size))
        if len(values) == 4 or not ordered:
            break
    return values


def to_sympy(latex: str) -> Any | None:
    """A sympy expression for a plain LaTeX value (fractions, roots, powers, trig, pi), else None."""
    s = _latex_to_python(latex)
    if s is None or len(s) > MAX_SYMPY_CHARS or not _SAFE.match(s) or re.search(r"\.\s*[A-Za-z]", s):
        return None  # only arithmetic on whitelisted names reaches sympy's parser (it evaluates Python)
    words = {w for w in re.findall(r"[A-Za-z]{2,}", s) if w not in _ALLOWED_NAMES}
    if not all(_splittable(w) for w in words):
        return None
    s = re.sub(r"[A-Za-z]{2,}", lambda m: m[0] if m[0] in _ALLOWED_NAMES else " ".join(m[0]), s)  # xy -> x y
    if _TOWER.search(s) or _HUGE.search(s):
        return None  # towers, huge powers and factorials: not worth a bignum
    import sympy  # noqa: PLC0415
    from sympy.parsing.sympy_parser import (  # noqa: PLC0415
        convert_xor,
        factorial_notation,
        implicit_multiplication_application,
        parse_expr,
        standard_transformations,
    )

    letters = "abcdefghjklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # no i: the imaginary unit
    names: dict[str, Any] = {c: sympy.Symbol(c) for c in letters}
    names.update({f: getattr(sympy, {"ln": "log"}.get(f, f.replace("arc", "a"))) for f in _FUNCS})
    names.update(i=sympy.I, pi=sympy.pi, oo=sympy.oo, sqrt=sympy.sqrt, factorial=sympy.factorial,
                 Abs=sympy.Abs, root=sympy.root)
    transformations = standard_transformations + (
        factorial_notation, implicit_multiplication_application, convert_xor
    )
    try:
        return parse_expr(
            s, local_dict=names, global_dict=_sympy_namespace(), transformations=transformations,
            evaluate=False,
        )
    except Exception:  # noqa: BLE001 - an unreadable expression means "cannot tell"
        return None


_NAMESPACE: dict[str, Any] = {}
_NOT_PRODUCTS = ("and", "or", "odd", "cm", "mm", "km", "kg", "in")


def _sympy_namespace() -> dict[str, Any]:
    """sympy's names without Python's builtins: the parser evaluates the text it builds."""
    if not _NAMESPACE:
        exec("from sympy import *", _NAMESPACE)  # noqa: S102 - a fixed import, no user text
        _NAMESPACE["__builtins__"] = {}
    return _NAMESPACE


def _splittable(word: str) -> bool:
    """Implicit products of single letters (``xy``) are fine; other words (``cm``, ``odd``) are not values."""
    return len(word) <= 3 and word.islower() and word not in _NOT_PRODUCTS


def _latex_to_python(s: str) -> str | None:
    s = s.replace("\x01", "(").replace("\x02", ")")
    if "\\begin" in s or "\\\\" in s or "_" in s or "|" in s or "\\sum" in s or "\\int" in s:
        return None
    s = re.sub(r"\\[,;:! ]", " ", s)
    s = s.replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/").replace("\\infty", "oo")
    s = s.replace("\\pi", " pi ").replace("\\ln", "\\log")
    s = re.sub(r"\\sqrt\s*\[([^\[\]]+)\]", r"\\root[\1]", s)
    s = _DECIMAL.sub(lambda m: "({0.numerator}/{0.denominator})".format(Fraction(m[0])), s)  # exact decimals
    # 3\frac{1}{3} is the mixed number 10/3, not 3 * 1/3 (as in value_equal)
    s = re.sub(r"(?<![\w.)}])(\d+)\s*\\frac\s*\{(\d+)\}\s*\{(\d+)\}", r"(\1+(\2)/(\3))", s)
    for _ in range(20):  # innermost-first rewrites of braced commands
        new = re.sub(r"\\frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"((\1)/(\2))", s)
        new = re.sub(r"\\frac\s*(\d)\s*(\d)", r"((\1)/(\2))", new)
        new = re.sub(r"\\frac\s*\{([^{}]*)\}\s*(\w)", r"((\1)/(\2))", new)
        new = re.sub(r"\\frac\s*(\w)\s*\{([^{}]*)\}", r"((\1)/(\2))", new)
        new = re.sub(r"\\root\[([^\[\]]*)\]\s*\{([^{}]*)\}", r"((\2)**(1/(\1)))", new)
        new = re.sub(r"\\sqrt\s*\{([^{}]*)\}", r"sqrt(\1)", new)
        new = re.sub(r"\\sqrt\s*(\w)", r"sqrt(\1)", new)
        new = re.sub(r"\^\s*\{([^{}]*)\}", r"**(\1)", new)
        if new == s:
            break
        s = new
    s = re.sub(r"\^\s*(\w)", r"**\1", s)
    funcs = "|".join(_FUNCS)
    s = re.sub(rf"\\({funcs})\s*\*\*\s*(\(?[\w.]+\)?)\s*(\([^()]*\)|\w+)", r"(\1(\3))**\2", s)  # \sin^2 x
    s = re.sub(rf"\\({funcs})\s*(\([^()]*\)|[A-Za-z0-9]+)", r"\1(\2)", s)
    s = s.replace("{", "(").replace("}", ")")
    if "\\" in s:
        return None
    return re.sub(r"\s+", " ", s).strip() or None
