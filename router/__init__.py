"""The router: one OpenAI endpoint over an InferenceService's encoder, prefill and decode pools."""
