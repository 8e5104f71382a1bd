"""`python -m toolkit.bench`: one benchmark worker (toolkit/bench/worker.py), started by the parent's Worker."""

from toolkit.bench.worker import worker_main

worker_main()
