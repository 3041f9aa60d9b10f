"""Algorithm-agnostic data-parallel engine: devices, workers, replicas, fan-out."""

from llmcompressor_parallel.engine.devices import resolve_devices, validate_data_parallel
from llmcompressor_parallel.engine.fan_out import FanOut
from llmcompressor_parallel.engine.replicate import NotReplicable, ReplicaSet
from llmcompressor_parallel.engine.worker_pool import DeviceWorkerPool, ReplicaError

__all__ = [
    "DeviceWorkerPool",
    "FanOut",
    "NotReplicable",
    "ReplicaError",
    "ReplicaSet",
    "resolve_devices",
    "validate_data_parallel",
]
