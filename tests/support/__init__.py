"""What the tests share: launching, the clusters and hosts they start, data they make, checks.

    launch.py         launch a command as a user would, never hang (and wait_then)
    checks.py         a run that succeeded (ok, succeeded); what an error line is, and the one a failure must give
    needs.py          require(): under CI=true a missing component fails, elsewhere it skips
    commands.py       the scripts and the small argument sets the tests launch them with
    image_data.py     small image folders and CIFAR-10 files
    bert_data.py      small prepared BERT data sets
    slurm_cluster.py  a real Slurm cluster on this machine (or on hosts.py's hosts)
    slurm_jobs.py     the sbatch files' jobs: probes, events, requeue checks
    hosts.py          hosts on one machine: network namespaces on a bridge, each with sshd
    fault_cells.py    the fault matrix's cells (tests/test_faults.py, tools/fault_matrix.py)
    machine.py        the machine's cores: shared by most tests, whole for the 16-rank ones
    locks.py          run.lock files as another run would have written them
    checkpoints.py    the checkpoint files of an output directory by name: step-N.pt, best.pt, sidecars
    weights.py        loading checkpoints, and comparing the weights of two runs (fp32 across batch splits)
    costs.py          each test's CPU-seconds, summed up at the end of the run
    selected.py       which parameters of a test this session selected (a fixture launches only those)

Imported as ``support.<module>``: pytest.ini puts tests/ (and scripts/) on the
path of the test process, and `make setup` adds both to the venv (a .pth file)
for what the tests launch (tests/workers/) and for tools/. Nothing here imports
a test module or conftest.py; the session fixtures live in tests/conftest.py.
"""
