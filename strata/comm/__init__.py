"""L4, bytes between devices: process groups (world.py), collectives behind one interface
(collectives.py: Communicator; gloo on CPU, NCCL on CUDA), the shared-memory all-reduce for ranks
on one host (shm.py), the alpha-beta cost model that picks per message (alpha_beta.py), local
rank processes (launch.py) and one rank of `strata bench comm` (bench_worker.py)."""
