"""The engine core: scheduler, KV cache manager, the KV connector interface, requests and the
messages the core exchanges with the front end. It knows token ids only."""
