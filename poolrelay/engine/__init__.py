"""Engine pools (vLLM, SGLang): KV events over ZeroMQ, load from Prometheus metrics, readiness over HTTP."""
