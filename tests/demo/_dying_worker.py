"""A TP worker entry that dies at start on rank 1 (imported by name in the spawned worker,
so it lives in a module of its own): ``WorkerGroup`` must say so at once, with the rank and
its exit code."""

import os

EXIT_CODE = 7


def die_on_rank_1(rank, *args):
    if rank == 1:
        os._exit(EXIT_CODE)
    from kvxfer.demo.tp import _worker

    _worker(rank, *args)
