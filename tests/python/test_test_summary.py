"""scripts/test_summary.py, the test command's closing line: a Rust test
binary that crashed (a signal, the OOM killer) prints no `test result:` line,
and its tests vanished from the count while CI stayed green."""

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "test_summary.py"

RAN = """\
     Running unittests src/lib.rs (target/debug/deps/a-1)
test result: ok. 3 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; finished in 0.01s
   Doc-tests a
test result: ok. 2 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.00s
"""
CRASHED = """\
     Running tests/big.rs (target/debug/deps/big-2)
error: test failed, to rerun pass `-p a --test big`
"""


def summary(tmp_path: Path, text: str, *extra: str) -> tuple[str, int]:
    cargo = tmp_path / "cargo.txt"
    cargo.write_text(text)
    done = subprocess.run([sys.executable, str(SCRIPT), "--cargo", str(cargo), *extra], capture_output=True, text=True)
    return done.stdout.strip().splitlines()[-1], done.returncode


def test_a_clean_run_counts_every_result(tmp_path):
    assert summary(tmp_path, RAN) == ("5 passed, 0 failed, 1 skipped", 0)


def test_a_test_binary_without_a_result_is_a_failure(tmp_path):
    assert summary(tmp_path, RAN + CRASHED, "--cargo-status", "101") == ("5 passed, 1 failed, 1 skipped", 1)


def test_cargo_failing_with_nothing_counted_is_a_failure(tmp_path):
    assert summary(tmp_path, RAN, "--cargo-status", "101") == ("5 passed, 1 failed, 1 skipped", 1)


def test_pytest_failing_with_nothing_counted_is_a_failure(tmp_path):
    # An INTERNALERROR can leave a failing test out of pytest's report.
    junit = tmp_path / "python.xml"
    junit.write_text('<testsuites><testsuite tests="2" failures="0" errors="0" skipped="0"/></testsuites>')
    args = ("--junit", str(junit))
    assert summary(tmp_path, RAN, *args) == ("7 passed, 0 failed, 1 skipped", 0)
    assert summary(tmp_path, RAN, *args, "--pytest-status", "3") == ("7 passed, 1 failed, 1 skipped", 1)
