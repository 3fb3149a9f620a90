#!/usr/bin/env python3
"""Adds up what scripts/test.sh ran and prints one closing line:
`N passed, N failed, N skipped`.

Inputs: cargo test's output (its `test result:` lines; ignored tests count as
skipped) and pytest's JUnit XML files. A step that could not run at all is
passed as `--broken NAME` and counts as one failure, so a missing tool can
never look like success.
"""

import argparse
import re
import sys
import xml.etree.ElementTree as ET

RESULT = re.compile(r"test result: \w+\. (\d+) passed; (\d+) failed; (\d+) ignored")
# Each test binary cargo runs (and each crate's doctests) announces itself,
# then ends with one `test result:` line, unless it crashed.
STARTED = re.compile(r"^\s+(Running|Doc-tests) ", re.M)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cargo", action="append", default=[], help="cargo test output")
    ap.add_argument("--junit", action="append", default=[], help="pytest --junitxml file")
    ap.add_argument("--cargo-status", type=int, default=0, help="cargo test's exit status")
    ap.add_argument("--pytest-status", type=int, default=0, help="pytest's exit status")
    ap.add_argument("--broken", action="append", default=[], help="a step that could not run")
    args = ap.parse_args()

    passed = failed = skipped = 0
    cargo_failed = 0
    for path in args.cargo:
        text = open(path, errors="replace").read()
        results = RESULT.findall(text)
        for m in results:
            passed += int(m[0])
            cargo_failed += int(m[1])
            skipped += int(m[2])
        crashed = len(STARTED.findall(text)) - len(results)
        if crashed > 0:
            print(f"{path}: {crashed} test binaries ended without a result (crashed or killed)", file=sys.stderr)
            cargo_failed += crashed
    if args.cargo_status != 0 and cargo_failed == 0:
        print(f"cargo test exited {args.cargo_status} with no failed test counted", file=sys.stderr)
        cargo_failed = 1
    failed += cargo_failed
    pytest_failed = 0
    for path in args.junit:
        try:
            root = ET.parse(path).getroot()
        except (OSError, ET.ParseError):
            print(f"no pytest report at {path}: counted as a failure", file=sys.stderr)
            pytest_failed += 1
            continue
        for suite in root.iter("testsuite"):
            tests, fails = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
            skips = int(suite.get("skipped", 0))
            passed += tests - fails - skips
            pytest_failed += fails
            skipped += skips
    # pytest's INTERNALERROR (a hook raising, say) can leave a failing test
    # out of its report: its status counts, as cargo's does.
    if args.pytest_status != 0 and pytest_failed == 0:
        print(f"pytest exited {args.pytest_status} with no failed test counted", file=sys.stderr)
        pytest_failed = 1
    failed += pytest_failed
    for step in args.broken:
        print(f"step that could not run: {step}", file=sys.stderr)
        failed += 1
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
