"""The paged KV cache: block pool, prefix-cache hashing and the per-request manager."""

from kvferry.engine.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from kvferry.engine.core.kv_cache.manager import KVCacheManager

from kvferry.protocol.block_hash import hash_block_tokens, hash_request_blocks

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager", "hash_block_tokens", "hash_request_blocks"]
