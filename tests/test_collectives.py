"""Horovod's collectives on both transports, launched for real with horovodrun."""
import pytest

from launch import REPO, horovodrun

WORKER = REPO / "tests" / "workers" / "collectives.py"


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_collectives_two_ranks(transport, need_horovod, need_mpi):
    run = horovodrun(2, [WORKER], timeout=120, transport=transport)
    assert run.returncode == 0 and not run.timed_out, run.describe()
    for rank in range(2):
        assert f"collectives ok rank={rank} size=2" in run.rank_output(rank), run.describe()
