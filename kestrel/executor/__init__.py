"""Executors: the engine's Runner over worker processes (multiprocessing) or Ray actors, each a worker running a
model runner shard. Above `kestrel.worker`; `kestrel.distributed` below it holds the process groups."""
