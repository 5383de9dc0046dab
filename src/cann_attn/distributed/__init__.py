"""Context parallelism over torch.distributed (docs/guides/context_parallel.md): sequence shards of FlashAttention
(ring and Ulysses) and of the DSA operators, with gloo on CPU and NCCL on GPU."""

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
