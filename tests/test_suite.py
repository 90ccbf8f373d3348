"""The suite itself: every test of every tier (`make test`, `make test-scale`) finds its
fixtures. A tier's tests run in another command, so a fixture removed while trimming one
tier left a test of the other failing only when that tier ran (2026-12-03: make test-scale's
16-rank resume lost `sixteen_under_mpirun`)."""

from support.launch import REPO, python


def test_every_test_of_every_tier_finds_its_fixtures():
    """`pytest --setup-plan` over both tiers: each test's fixtures resolved, none run."""
    planned = python(["-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--setup-plan", "-q",
                      REPO / "tests"], timeout=120, env={"HVDTEST_TIER": "all"})
    assert planned.returncode == 0 and "not found" not in planned.output, planned.describe()
