"""The OpenAI-compatible HTTP front of a global frontend (Starlette on uvicorn, in the gRPC server's loop)."""
