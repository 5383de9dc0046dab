"""Context parallelism over torch.distributed (docs/guides/context_parallel.md): sequence shards of FlashAttention
(ring and Ulysses) and of the DSA operators, with gloo on CPU and NCCL on GPU."""

import inspect as _inspect

from ..errors import keywords_checked as _keywords_checked
from .attention import dropout_mask, flash_attention, seq_dim
from .comm import ContextParallelError, comm_stats, reset_comm_stats
from .dsa import indexer_kl_loss, lightning_indexer, sparse_attention
from .sharding import shard, unshard

__all__ = [
    "ContextParallelError",
    "comm_stats",
    "dropout_mask",
    "flash_attention",
    "indexer_kl_loss",
    "lightning_indexer",
    "reset_comm_stats",
    "seq_dim",
    "shard",
    "sparse_attention",
    "unshard",
]

# A keyword a public function does not take is refused naming the one the caller most likely meant, as for the
# functions of cann_attn (errors.keywords_checked).
for _name in __all__:
    if _inspect.isfunction(globals()[_name]):
        globals()[_name] = _keywords_checked(globals()[_name])
del _name
