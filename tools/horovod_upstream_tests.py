"""Horovod's own tests (v0.28.1) against the Horovod make setup installed: what the series changed.

    python tools/horovod_upstream_tests.py                      # every suite (make test-horovod)
    python tools/horovod_upstream_tests.py --suites single parallel-gloo

The suites, copied unchanged from horovod/horovod at v0.28.1 into
scripts/setup/horovod/upstream-tests/: `single` (test_elastic_driver.py,
test_elastic_discovery.py, test_torch_elastic.py), `integration` (test_elastic_torch.py: real
elastic jobs), `parallel-gloo` and `parallel-mpi` (test_torch.py at 2 ranks under horovodrun
--gloo and --mpi). Every test is expected to pass but those of expected-failures.txt, each of
which names what makes it fail: a patch of the series (a deliberate difference, with the
settings that give upstream's behaviour back: the test is run again under them and must pass
there), or something outside the series (today's PyTorch). Each expected failure runs alone,
with a time limit (one hangs by design). Exit 1 when a test fails unexpectedly, or an expected
failure passes, or passes not under its settings; a table of what ran, and where.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "scripts" / "setup" / "horovod" / "upstream-tests"
EXPECTED = TESTS / "expected-failures.txt"
BIN = Path(sys.executable).parent
SUITES = {
    "single": (["test/single/test_elastic_driver.py", "test/single/test_elastic_discovery.py",
                "test/single/test_torch_elastic.py"], None),
    "integration": (["test/integration/test_elastic_torch.py"], None),
    "parallel-gloo": (["test/parallel/test_torch.py"], "--gloo"),
    "parallel-mpi": (["test/parallel/test_torch.py"], "--mpi"),
}
SUITE_SECONDS = 1500
ALONE_SECONDS = 90  # an expected failure run alone; longer is a hang


def expected_failures():
    """[(suite, test id, always, cause, settings)] from expected-failures.txt
    ('suite | id | always or sometimes | cause | settings')."""
    entries = []
    for line in EXPECTED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            suite, test, how, cause, settings = (part.strip() for part in line.split("|"))
            entries.append((suite, test, how == "always", cause, dict(pair.split("=", 1) for pair in settings.split()
                                                      if settings != "-")))
    return entries


def pytest_command(suite, tests, junit):
    files, transport = SUITES[suite]
    # A thread's uncaught exception is a failure, not a warning (a driver thread that raised).
    # Its own pytest.ini (upstream-tests/, rootdir there): not the repository's.
    # deselect_exact (ours): the tests of HVDTRAIN_DESELECT left out, by their exact ids.
    # --capture=sys: what Horovod's C++ and Gloo write reaches the log (captured at the file
    # descriptor, a rank that aborts took its last words with it: "Fatal Python error" alone).
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys",
              "-c", str(TESTS / "pytest.ini"),
              "-p", "deselect_exact", "-W", "error::pytest.PytestUnhandledThreadExceptionWarning", *(tests or files)]
    if transport is None:
        return pytest + ["--junitxml", str(junit)]
    # Each rank writes its own report: RANK is Horovod's under Gloo, Open MPI's under mpirun.
    each_rank = " ".join(f"'{word}'" for word in pytest) + f" --junitxml {junit}.rank$RANK.xml"
    return [str(BIN / "horovodrun"), "-np", "2", transport, "sh", "-c",
            "RANK=${HOROVOD_RANK:-$OMPI_COMM_WORLD_RANK}; exec " + each_rank]


def outcomes(junit):
    """{test id: 'passed' | 'failed' | 'skipped'} from one JUnit report, or from each rank's
    (failed on any rank is failed)."""
    found = {}
    reports = [junit] if junit.exists() else sorted(junit.parent.glob(junit.name + ".rank*.xml"))
    for report in reports:
        for case in ElementTree.parse(report).iter("testcase"):
            path = case.get("classname", "").replace(".", "/")
            module, _, cls = path.rpartition("/") if "/" in path else (path, "", "")
            test_id = f"{module}.py::{cls}::{case.get('name')}" if cls and cls[0].isupper() \
                else f"{path}.py::{case.get('name')}"
            outcome = ("failed" if case.find("failure") is not None or case.find("error") is not None
                       else "skipped" if case.find("skipped") is not None else "passed")
            if found.get(test_id) != "failed":
                found[test_id] = outcome
    return found


def run(command, env, seconds, log):
    started = time.monotonic()
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, cwd=TESTS, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=seconds, start_new_session=True).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    return code, time.monotonic() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suites", nargs="+", choices=list(SUITES), default=list(SUITES))
    parser.add_argument("--output", type=Path, help="where the logs and reports go (default: a new temporary folder)")
    args = parser.parse_args()
    out = args.output or Path(tempfile.mkdtemp(prefix="horovod-upstream-"))
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))}
    expected = [entry for entry in expected_failures() if entry[0] in args.suites]
    problems, summary = [], {}
    for suite in args.suites:
        skip = "\n".join(test for in_suite, test, _, _, _ in expected if in_suite == suite)
        junit = out / f"{suite}.xml"
        code, seconds = run(pytest_command(suite, None, junit), {**env, "HVDTRAIN_DESELECT": skip}, SUITE_SECONDS,
                            out / f"{suite}.log")
        found = outcomes(junit) if code != "timeout" else {}
        counts = {kind: sum(1 for outcome in found.values() if outcome == kind) for kind in ("passed", "failed", "skipped")}
        summary[suite] = {**counts, "seconds": round(seconds), "exit": code}
        print(f"{suite}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
              f"in {seconds:.0f} s (exit {code}; log {out / (suite + '.log')})", flush=True)
        if code == "timeout" or not found:
            problems.append(f"{suite}: no report (exit {code}): see {out / (suite + '.log')}")
        problems += [f"{suite}: {test} failed, not an expected failure" for test, outcome in found.items()
                     if outcome == "failed"]
    for number, (suite, test, always, cause, settings) in enumerate(expected):
        junit = out / f"expected-{number}.xml"
        code, seconds = run(pytest_command(suite, [test], junit), env, ALONE_SECONDS, out / f"expected-{number}.log")
        failed = code == "timeout" or outcomes(junit).get(test) == "failed"
        line = (f"{suite}: {test}: {'hangs' if code == 'timeout' else 'fails' if failed else 'passes'}"
                f"{'' if always else ' (fails sometimes)'} ({cause})")
        if always and not failed:
            problems.append(f"{suite}: {test} passes: take it off {EXPECTED.relative_to(REPO)}")
        if settings:
            junit = out / f"expected-{number}-stock.xml"
            code, _ = run(pytest_command(suite, [test], junit), {**env, **settings}, ALONE_SECONDS,
                          out / f"expected-{number}-stock.log")
            passed = code != "timeout" and outcomes(junit).get(test) == "passed"
            line += f"; under {' '.join(f'{k}={v}' for k, v in settings.items())}: {'passes' if passed else 'FAILS'}"
            if not passed:
                problems.append(f"{suite}: {test} fails under the settings that should give upstream's behaviour back")
        summary.setdefault("expected", []).append(line)
        print(line, flush=True)
    (out / "summary.json").write_text(json.dumps({"summary": summary, "problems": problems}, indent=1))
    for problem in problems:
        print("UNEXPECTED: " + problem)
    print(f"{len(problems)} unexpected; reports in {out}")
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
