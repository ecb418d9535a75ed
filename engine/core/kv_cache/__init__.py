"""The paged KV cache: block pool, prefix-cache hashing and the per-request manager."""

from kvferry.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvferry.engine.kv_cache.hashing import hash_block_tokens, hash_request_blocks
from kvferry.engine.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager", "hash_block_tokens", "hash_request_blocks"]
