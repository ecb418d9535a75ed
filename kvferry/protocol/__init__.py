"""Contracts between kvferry's processes that are not the engine itself.

Both sides of each import it from here, so neither reaches into the other's internals:

- `registry`: the pod registry in Redis (key layout and the `PodRecord` a pod publishes);
- `kv_events`: the KV event stream the engines write and the router reads;
- `block_hash`: the chained block hash the engines' prefix caches and the router compute;
- `errors`: the OpenAI-shaped error body every server answers with.

Nothing here imports torch, the engine or a web framework.
"""
