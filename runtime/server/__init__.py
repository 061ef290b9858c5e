"""OpenAI-compatible HTTP server (FastAPI + uvicorn + sse-starlette): see app.py."""
