"""Hosts and processes before training starts: hostfiles and allocations, the MPI
world of the data preparation."""
