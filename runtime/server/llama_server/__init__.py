"""llama-server's own routes and compat pieces: /completion, /tokenize and the rest (routes.py,
schemas.py), slot actions (slots.py), LoRA adapters (lora.py), /rerank (rerank.py), its
``llamacpp:*`` metrics (metrics.py), the routes not served here (unsupported.py), Vertex AI's
/predict (gcp_predict.py) and the web UI's CORS proxy (cors_proxy.py)."""
