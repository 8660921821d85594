"""DeepSpeed's bucket sizes as XLA's collective-combine thresholds.

XLA combines small collectives of one kind into one larger collective up to a byte threshold;
that is what DeepSpeed's buckets control. The thresholds are per-executable compile options
(passed to ``jax.jit(..., compiler_options=...)``), so they apply to the train step only and
need no XLA_FLAGS set before the backend starts:

* ``reduce_bucket_size`` (bytes) -> ``xla_gpu_all_reduce_combine_threshold_bytes`` and
  ``xla_gpu_reduce_scatter_combine_threshold_bytes`` (gradient reduction, ZeRO 0/1 and 2/3);
* ``allgather_bucket_size`` (bytes) -> ``xla_gpu_all_gather_combine_threshold_bytes``
  (stage-3 weight gathers and the updated-parameter gathers of stages 1/2).

The XLA CPU backend accepts these options and has no combiner they steer (CPU runs are for
correctness, not speed). DeepSpeed knobs with no XLA meaning are refused by the config
(:data:`WITHOUT_XLA_MEANING`).
"""
from __future__ import annotations

REDUCE_OPTIONS = ("xla_gpu_all_reduce_combine_threshold_bytes",
                  "xla_gpu_reduce_scatter_combine_threshold_bytes")
ALLGATHER_OPTIONS = ("xla_gpu_all_gather_combine_threshold_bytes",)

# DeepSpeed ZeRO knobs that have nothing to steer under XLA, and why.
WITHOUT_XLA_MEANING = {
    "overlap_comm": "XLA's latency-hiding scheduler overlaps collectives with compute itself",
    "contiguous_gradients": "XLA owns buffer layout; gradients have no separate copy to pack",
    "round_robin_gradients": "XLA partitions the gradient reduction itself",
    "allgather_partitions": "the parameter gathers are XLA all-gathers of the sharded arrays",
    "reduce_scatter": "ZeRO stage 2 and 3 always reduce-scatter; stages 0/1 all-reduce",
    "stage3_prefetch_bucket_size": "XLA schedules the stage-3 gathers of the compiled step; "
                                   "use parallel.allgather_bucket_size to size them",
    "stage3_max_live_parameters": "XLA's buffer assignment decides what stays live",
    "stage3_max_reuse_distance": "XLA's buffer assignment decides what stays live",
    "stage3_param_persistence_threshold": "every stage-3 parameter that divides is sharded; "
                                          "those that do not divide stay replicated",
    "sub_group_size": "the optimizer update is one fused XLA computation",
    "offload_param": "parameter offload is not built (optimizer offload is: "
                     "parallel.offload_optimizer)",
}


def _check_bytes(name: str, value) -> None:
  if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
    raise ValueError(f"{name}={value!r} is not allowed; use a number of bytes >= 1, or None")


def combine_options(reduce_bucket_size: int | None = None,
                    allgather_bucket_size: int | None = None) -> dict[str, int]:
  """XLA compile options for the given bucket sizes (bytes; None: XLA's default)."""
  _check_bytes("reduce_bucket_size", reduce_bucket_size)
  _check_bytes("allgather_bucket_size", allgather_bucket_size)
  out = {}
  if reduce_bucket_size is not None:
    out.update({name: reduce_bucket_size for name in REDUCE_OPTIONS})
  if allgather_bucket_size is not None:
    out.update({name: allgather_bucket_size for name in ALLGATHER_OPTIONS})
  return out
