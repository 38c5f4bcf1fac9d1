"""``freetoken serve``: the loaded model behind an OpenAI-compatible HTTP API (:mod:`freetoken.serve.app`).

One model, one sequence engine: requests wait in a queue for the worker thread that owns the model
(:mod:`freetoken.serve.worker`); the routes (:mod:`freetoken.serve.openai_api`) validate requests
(:mod:`freetoken.serve.schemas`), render prompts and stream the worker's text back over SSE.
"""
