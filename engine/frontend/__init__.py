"""The front end: the offline `LLM`, the in-process `LLMEngine`, the server's `AsyncLLM` and
its engine-core process, and the tokenization / detokenization around the core."""
