"""The paged KV cache: block pool (with its KV event log) and the per-request manager. The
block hash it indexes by is `kvferry.protocol.block_hash`, shared with the router."""

from kvferry.engine.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvferry.engine.core.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager"]
