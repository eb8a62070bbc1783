"""Tensor parallelism and data-parallel replicas.

A run on `WORLD_SIZE` processes splits each model over `tp_size` of them (`tensor_parallel`) and makes
`WORLD_SIZE // tp_size` replicas of that (`mesh`). Replicas pool their finished samples and share the batch out
by Σ L² (`replicas`), sum their gradients, divide Adam's moments between them (`sharded_adam`) and check now and
then that they still hold the same weights (`weight_check`). Exports are lazy: `ParallelConfig` needs no torch.
"""

_EXPORTS = {
    "ParallelConfig": "config", "exit_process": "process_exit", "launched": "process_exit",
    "Mesh": "mesh", "init_mesh": "mesh", "close_mesh": "mesh",
    "apply_tensor_parallel": "tensor_parallel", "full_state_dict": "tensor_parallel",
    "load_full_state_dict": "tensor_parallel", "local_head_counts": "tensor_parallel",
    "SharedPool": "replicas", "ReadinessGate": "replicas", "assign": "replicas", "select_oldest": "replicas",
    "my_share": "replicas", "pooled_loss_denominator": "replicas", "reduce_gradients": "replicas",
    "sum_over_replicas": "replicas", "broadcast_parameters": "replicas", "imbalance": "replicas",
    "ShardedAdamW": "sharded_adam", "shard_filename": "sharded_adam",
    "check_replica_weights": "weight_check", "ReplicaDivergence": "weight_check",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"agentrl.parallel.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'agentrl.parallel' has no attribute {name!r}")
