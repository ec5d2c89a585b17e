"""The engine side: the HF receiver and its consumers, the KL gate, megatron-core's static
inference engine and the model config it is built from, and the adapters that drive vLLM's and
SGLang's own weight-update protocols."""
