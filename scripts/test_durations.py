"""Write tests/durations.json, each test file's seconds in a run of the suite, from that run's JUnit XML
(``make test PYTEST_ARGS=--junitxml=run.xml``, then ``python scripts/test_durations.py run.xml``).

tests/conftest.py hands the files to the test processes longest first, so that the suite's last minutes are
short files on both processes, not one long file on one of them. A stale or missing entry costs only balance:
a file without one goes first."""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "durations.json"


def file_of(classname: str) -> str:
    """``tests.e2e.test_x`` or ``tests.e2e.test_x.TestY`` -> ``tests/e2e/test_x.py``."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        path = "/".join(parts[:end]) + ".py"
        if (ROOT / path).is_file():
            return path
    raise SystemExit(f"{classname}: no test file under {ROOT} matches this JUnit classname")


def main(junit_xml: str) -> None:
    seconds: Counter[str] = Counter()
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        # a module skipped whole is one case named after the module, with no classname
        seconds[file_of(case.get("classname") or case.get("name", ""))] += float(case.get("time", 0.0))
    if not seconds:
        raise SystemExit(f"{junit_xml}: no <testcase> in it")
    OUT.write_text(json.dumps({path: round(s, 1) for path, s in sorted(seconds.items())}, indent=0) + "\n")
    print(f"{OUT}: {len(seconds)} files, {sum(seconds.values()):.0f} s of tests")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python scripts/test_durations.py RUN.xml")
    main(sys.argv[1])
