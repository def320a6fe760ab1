"""`cflow serve`: an OpenAI-compatible HTTP API and a chat page around one cflow.LLM.

  app.py       create_app(llm, ...): the Starlette app (endpoints, errors, streaming)
  schemas.py   request bodies, their checks, the OpenAI-style error object
  batcher.py   continuous batching: N sequence slots, one engine step for all of them
  metrics.py   Prometheus metrics
  static/      the chat page (plain HTML, CSS, JavaScript)
Needs the `serve` extra (starlette via fastapi, uvicorn, prometheus_client); never imports torch.
"""

from cflow.server.app import create_app

__all__ = ["create_app"]
