"""`python -m toolkit.apps.bench`: one benchmark worker (toolkit/apps/bench/worker.py), started by the parent's Worker."""

from toolkit.apps.bench.worker import worker_main

worker_main()
