"""`make setup` is idempotent: a second run reuses the cached Horovod wheel."""
import re
import time

from launch import launch


def test_second_setup_is_quick_and_horovod_has_every_backend(need_horovod):
    started = time.monotonic()
    run = launch(["bash", "scripts/setup/setup.sh"], timeout=300)
    assert run.returncode == 0, run.describe()
    assert "building Horovod" not in run.output, "setup rebuilt Horovod instead of reusing it"
    assert "PyTorch, MPI and Gloo available" in run.output
    print(f"second setup took {time.monotonic() - started:.1f} s")

    check = launch(["horovodrun", "--check-build"], timeout=60)
    for feature in ("PyTorch", "MPI", "Gloo"):
        assert re.search(rf"\[X\] {feature}\b", check.output), check.describe()

