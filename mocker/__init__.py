"""mocker: a simulated LLM serving pool (serving link, pool-local event API, admin API)."""
