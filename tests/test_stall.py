"""A frozen rank must end the job, not hang it, on both transports.

hvdtrain.dist.init starts a progress watchdog on every rank (Horovod's own
stall shutdown does not work under Gloo). Here its fixed limit applies even
before the first step; tests/test_faults.py covers the trainers' adaptive one.
"""
import time

import pytest

from support.launch import REPO, horovodrun

WORKER = REPO / "tests" / "workers" / "frozen_rank.py"


@pytest.mark.parametrize("transport", ["gloo", pytest.param("mpi", marks=pytest.mark.scale)])
def test_frozen_rank_ends_the_job(transport, need_horovod, need_mpi):
    started = time.monotonic()
    run = horovodrun(2, [WORKER], timeout=120, transport=transport,
                     env={"HVDTRAIN_WATCHDOG_SECONDS": "10"})
    elapsed = time.monotonic() - started
    assert not run.timed_out, run.describe()
    assert run.returncode != 0, run.describe()
    assert "rank 0 waiting in allreduce" in run.output
    assert "should not happen" not in run.output
    print(f"{transport}: frozen-rank job ended after {elapsed:.0f} s")
