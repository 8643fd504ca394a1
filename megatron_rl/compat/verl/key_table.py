"""The table of every verl key and its fate in docs/configuration.md, generated from the code the compat entry
runs (``keys.fate_of``, ``defaults.FIXED`` / ``defaults.verl_defaults``) so that the page cannot drift from it.

``python -m megatron_rl.compat.verl.key_table`` prints the section; ``--write`` replaces it in
docs/configuration.md, between the markers below (tests/compat/test_verl_key_table.py checks that they agree).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from omegaconf import DictConfig, ListConfig, OmegaConf

from megatron_rl.compat.verl import defaults
from megatron_rl.compat.verl.keys import Fate, Rule, fate_of, rule_for, verl_config

DOC = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"
START = "<!-- verl-key-table:start -->"
END = "<!-- verl-key-table:end -->"
SCRIPTS = Path(__file__).resolve().parents[3] / "tests" / "compat" / "verl_scripts"

# dicts whose entries are free-form (any key): a row for the dict itself, not for its entries
FREE_FORM = ("override_transformer_config", "engine_kwargs", "override_config")
_DEFAULT_WIDTH = 40
_MIN_SIBLINGS = 4  # fewer keys of one parent that share a fate get a row each, with their defaults

LEGEND: dict[Fate, str] = {
    Fate.same: "megatron-rl's schema has the key under verl's name: passed on and honoured as it is",
    Fate.mapped: "rewritten onto megatron-rl's key(s) that do the same (each rewrite is logged); some rewrites "
                 "check the value and refuse one that cannot be honoured, saying why",
    Fate.dropped: "accepted without effect (logged with the reason): verl does nothing with it on this path "
                  "either, or megatron-rl always does what it asks",
    Fate.default: "megatron-rl has no such setting and behaves as verl does at the key's default: verl's default "
                  "value is accepted (logged), any other value is refused, naming what to use instead",
    Fate.refused: "never accepted; the refusal gives the reason",
}


# ---------------------------------------------------------------------------------------------- verl's keys

@dataclass(frozen=True)
class Leaf:
    key: str
    default: Any  # the raw node value: interpolations unresolved, '???' for a mandatory value


def verl_leaves() -> list[Leaf]:
    """Every leaf of verl's config, in its order: free-form and empty dicts are leaves, ``_target_`` is skipped."""
    out: list[Leaf] = []

    def walk(node: DictConfig, prefix: str) -> None:
        for name in node.keys():
            if name == "_target_":
                continue
            key = f"{prefix}.{name}" if prefix else str(name)
            child = node._get_node(name)
            if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none() \
                    and not child._is_interpolation() and name not in FREE_FORM and len(child):
                walk(child, key)
            elif isinstance(child, (DictConfig, ListConfig)):
                out.append(Leaf(key, child if not child._is_interpolation() else child._value()))
            else:
                out.append(Leaf(key, child._value()))

    walk(verl_config(), "")
    return out


def verl_leaf_keys() -> list[str]:
    return [leaf.key for leaf in verl_leaves()]


def _show(value: Any, width: int | None = _DEFAULT_WIDTH) -> str:
    """verl's default, short, as YAML writes it, in backticks."""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value, resolve=False)
    text = _flow(value)
    if width is not None and len(text) > width:
        text = text[: width - 1] + "…"
    return "`" + text.replace("|", "\\|") + "`"


def _flow(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    if isinstance(value, str) and value == "":
        return "''"
    return str(value)


def _text(why: str) -> str:
    """A reason as table text: pipes, stars and tag-like <words> escaped."""
    why = why.replace("|", "\\|").replace("*", "\\*")
    return re.sub(r"<(?=[A-Za-z/])", r"\\<", why)


# ---------------------------------------------------------------------------------------------- rows

@dataclass(frozen=True)
class Row:
    label: str  # markdown for the key column
    keys: tuple[str, ...]  # the verl keys the row covers
    default: str  # markdown for the default column
    fate: Fate
    why: str


def _fate(key: str) -> tuple[Fate, str]:
    fate, why = fate_of(key)
    rule = rule_for(key)
    if fate is Fate.default and rule is not None and rule.accepts:
        why = f"{why} (also accepted: {', '.join(rule.accepts)})"
    return fate, why


def _spans(keys: list[str]) -> dict[str, tuple[int, int]]:
    """dotted prefix -> [first, last + 1) of the keys under it (contiguous: the walk is depth first)."""
    spans: dict[str, tuple[int, int]] = {}
    for i, key in enumerate(keys):
        parts = key.split(".")
        for depth in range(1, len(parts)):
            prefix = ".".join(parts[:depth])
            first, _ = spans.get(prefix, (i, i))
            spans[prefix] = (first, i + 1)
    return spans


def table_rows() -> list[Row]:
    """The rows of verl's config: ``same`` keys and keys a rule maps by name one a row; a run of consecutive keys
    with the same other fate (a rule's pattern mapping them too) and reason as ``prefix.*`` where it is everything
    under the prefix, else as ``parent.{a, b, ...}`` (or a row each, see ``_group``)."""
    leaves = verl_leaves()
    return rows_of(leaves, [_fate(leaf.key) for leaf in leaves], [rule_for(leaf.key) for leaf in leaves])


def rows_of(leaves: list[Leaf], fates: list[tuple[Fate, str]], rules: list[Rule | None]) -> list[Row]:
    """The rows of ``leaves`` (as ``table_rows``; sft_key_table's too), given each leaf's fate and reason and the
    rule that decided it."""
    keys = [leaf.key for leaf in leaves]
    spans = _spans(keys)
    rows: list[Row] = []
    i = 0
    while i < len(keys):
        fate, why = fates[i]
        rule = rules[i]
        if fate is Fate.same or (fate is Fate.mapped and (rule is None or "*" not in rule.pattern)):
            rows.append(Row(f"`{keys[i]}`", (keys[i],), _show(leaves[i].default), fate, why))
            i += 1
            continue
        end = i
        while end < len(keys) and fates[end] == (fate, why):
            end += 1
        rows.extend(_group(keys, leaves, spans, i, end, fate, why))
        i = end
    return rows


def _group(keys: list[str], leaves: list[Leaf], spans: dict[str, tuple[int, int]], start: int, end: int,
           fate: Fate, why: str) -> Iterator[Row]:
    """Rows for keys[start:end] (one fate and reason): whole subtrees as ``prefix.*``, four or more siblings as
    ``parent.{a, b, ...}``, the rest a row each."""
    items: list[tuple[str, tuple[str, ...]]] = []  # (prefix or key, keys covered)
    i = start
    while i < end:
        parts = keys[i].split(".")
        for depth in range(1, len(parts)):
            first, last = spans[".".join(parts[:depth])]
            if first == i and last <= end and last - first > 1:
                items.append((".".join(parts[:depth]) + ".*", tuple(keys[first:last])))
                i = last
                break
        else:
            items.append((keys[i], (keys[i],)))
            i += 1
    j = 0
    while j < len(items):
        label, covered = items[j]
        if label.endswith(".*"):
            yield Row(f"`{label}` ({len(covered)} keys)", covered, "", fate, why)
            j += 1
            continue
        parent = label.rpartition(".")[0]
        siblings = [label]
        while j + len(siblings) < len(items):
            other = items[j + len(siblings)][0]
            if other.endswith(".*") or other.rpartition(".")[0] != parent:
                break
            siblings.append(other)
        if len(siblings) < _MIN_SIBLINGS:
            for key in siblings:
                yield Row(f"`{key}`", (key,), _show(leaves[keys.index(key)].default), fate, why)
        else:
            names = ", ".join(s.rpartition(".")[2] for s in siblings)
            yield Row(f"`{parent}.{{{names}}}` ({len(siblings)} keys)", tuple(siblings), "", fate, why)
        j += len(siblings)


# ---------------------------------------------------------------------------------------------- the other tables

_SCENARIOS: tuple[tuple[str, dict[str, str]], ...] = (
    ("", {}),
    ("<role>.megatron.tensor_model_parallel_size > 1",
     {f"{role}.megatron.tensor_model_parallel_size": "2" for role in ("actor_rollout_ref.actor", "critic")}),
    ("trainer.device=cpu", {"trainer.device": "cpu"}),
)


def default_rows() -> list[tuple[str, str, str]]:
    """(key, value, why) of each verl default the compat entry applies before the user's arguments."""
    rows = [(f"`{key}`", _show(value, None), _text(why)) for key, value, why in defaults.FIXED]
    fixed = {key for key, _, _ in defaults.FIXED}
    values: dict[str, dict[str, str | None]] = {}
    whys: dict[str, str] = {}
    for label, seen in _SCENARIOS:
        out, notes = defaults.verl_defaults(seen)
        here = {}
        for override in out:
            key, _, value = override.partition("=")
            if key in fixed:
                continue
            here[key] = value
            note = next(n for n in notes if n.startswith(f"{override}: "))
            whys.setdefault(key, note[len(override) + 2:])
        for key in [*values, *(k for k in here if k not in values)]:
            values.setdefault(key, {})[label] = here.get(key)
    for key, by_scenario in values.items():
        base = by_scenario.get("")
        text = _show(base, None) if base is not None else "not set"
        for label, _ in _SCENARIOS[1:]:
            other = by_scenario.get(label)
            if other != base:
                text += f"; {_show(other, None) if other is not None else 'not set'} with `{label}`"
        rows.append((f"`{key}`", text, _text(whys[key])))
    return rows


def script_keys() -> list[tuple[str, list[str]]]:
    """(key as written, scripts) of the keys verl's example scripts add that verl's config has not: those written
    with ``+`` and those verl's config lacks."""
    verls = set(verl_leaf_keys())
    prefixes = {key.rsplit(".", n)[0] for key in verls for n in range(1, key.count(".") + 1)}
    return keys_in_scripts(SCRIPTS, lambda key: key.startswith("+") or (
        key.lstrip("+~") not in verls and key.lstrip("+~") not in prefixes))


def keys_in_scripts(scripts: Path, wanted: Callable[[str], bool]) -> list[tuple[str, list[str]]]:
    """(key as written, scripts) of the keys set in ``scripts``/*.args that ``wanted`` picks (sft_key_table's
    too), sorted."""
    found: dict[str, list[str]] = {}
    for path in sorted(scripts.glob("*.args")):
        for line in path.read_text().splitlines():
            key, sep, _ = line.strip().partition("=")
            if not sep or key.startswith("#") or not wanted(key):
                continue
            found.setdefault(key, [])
            if path.stem not in found[key]:
                found[key].append(path.stem)
    return sorted(found.items())


def fate_counts() -> Counter:
    return Counter(fate for key in verl_leaf_keys() for fate in [fate_of(key)[0]])


# ---------------------------------------------------------------------------------------------- markdown

def render() -> str:
    lines: list[str] = []
    add = lines.append
    counts = fate_counts()
    add("<!-- generated by `python -m megatron_rl.compat.verl.key_table --write` from "
        "megatron_rl/compat/verl/keys.py and defaults.py; do not edit by hand -->")
    add("")
    add("The five fates:")
    add("")
    for fate in Fate:
        add(f"- `{fate.value}` ({counts.get(fate, 0)} of verl's {sum(counts.values())} keys): {LEGEND[fate]}.")
    add("")
    add("A key neither verl nor megatron-rl has is left to megatron-rl's own checks, which name the nearest keys.")
    add("")
    add("### verl's defaults the entry applies")
    add("")
    add("Where megatron-rl's default differs from verl's in memory or numbers, the entry places verl's before the "
        "user's arguments (which win), and logs each (megatron_rl/compat/verl/defaults.py):")
    add("")
    add("| key | value | why |")
    add("|---|---|---|")
    for key, value, why in default_rows():
        add(f"| {key} | {value} | {why} |")
    add("")
    add("### verl's config, key by key")
    add("")
    add("Every key of verl's `ppo_megatron_trainer` config (pinned: "
        "megatron_rl/compat/verl/verl_ppo_megatron_trainer.yaml), in its order, with verl's default. `same` and "
        "`mapped` keys have a row each; consecutive keys of another fate that share the reason share a row: "
        "`prefix.*` is every key under the prefix, `parent.{a, b}` names them.")
    add("")
    rows = table_rows()
    section = None
    for row in rows:
        top = _section(row.keys[0])
        if top != section:
            if section is not None:
                add("")
            section = top
            add(f"#### `{top}`")
            add("")
            add("| verl key | verl default | fate | why |")
            add("|---|---|---|---|")
        add(f"| {row.label} | {row.default} | {row.fate.value} | {_text(row.why)} |")
    add("")
    add("### Keys verl's example scripts add")
    add("")
    add("Keys of verl's Megatron example scripts (tests/compat/verl_scripts/*.args) written with `+` or absent from "
        "verl's config:")
    add("")
    add(f"| key | in scripts (of {len(list(SCRIPTS.glob('*.args')))}) | fate | why |")
    add("|---|---|---|---|")
    for key, scripts in script_keys():
        fate, why = _fate(key.lstrip("+~"))
        add(f"| `{key}` | {len(scripts)} | {fate.value} | {_text(why)} |")
    return "\n".join(lines) + "\n"


def _section(key: str) -> str:
    parts = key.split(".")
    if parts[0] == "actor_rollout_ref" and len(parts) > 2:
        return ".".join(parts[:2])
    return parts[0] if len(parts) > 1 else "(top level)"


@dataclass(frozen=True)
class DocSection:
    """A generated section of a docs page, between two markers, and the command line that prints it or, with
    ``--write``, replaces it (this module's and sft_key_table's)."""
    doc: Path
    start: str
    end: str
    render: Callable[[], str]
    module: str  # as ``python -m`` runs it
    description: str | None

    @property
    def write_command(self) -> str:
        return f"python -m {self.module} --write"

    def current(self, text: str) -> str:
        """The generated part of ``text`` (the page), between the markers."""
        if self.start not in text or self.end not in text:
            raise ValueError(f"{self.doc} lacks the markers {self.start} ... {self.end}")
        return text.split(self.start, 1)[1].split(self.end, 1)[0].strip("\n") + "\n"

    def write(self, path: Path | None = None) -> bool:
        """Replace the generated section of ``path`` (the page); True if it changed."""
        path = self.doc if path is None else path
        text = path.read_text()
        self.current(text)  # the markers are there
        head, _, rest = text.partition(self.start)
        _, _, tail = rest.partition(self.end)
        new = f"{head}{self.start}\n{self.render()}{self.end}{tail}"
        if new == text:
            return False
        path.write_text(new)
        return True

    def main(self, argv: list[str] | None = None) -> None:
        parser = argparse.ArgumentParser(prog=f"python -m {self.module}", description=self.description)
        parser.add_argument("--write", action="store_true", help=f"replace the section in {self.doc}")
        args = parser.parse_args(argv)
        if args.write:
            changed = self.write()
            print(f"{self.doc}: {'updated' if changed else 'already current'}", file=sys.stderr)
        else:
            sys.stdout.write(self.render())


SECTION = DocSection(DOC, START, END, render, "megatron_rl.compat.verl.key_table", __doc__)
WRITE_COMMAND = SECTION.write_command
current_section, write, main = SECTION.current, SECTION.write, SECTION.main

if __name__ == "__main__":
    main()
