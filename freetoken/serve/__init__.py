"""``freetoken serve``: the loaded model behind OpenAI- and Anthropic-compatible HTTP APIs (:mod:`freetoken.serve.app`).

One model, one sequence engine: requests wait in a queue for the worker thread that owns the model
(:mod:`freetoken.serve.worker`). The routes (:mod:`freetoken.serve.openai_api`, :mod:`freetoken.serve.anthropic_api`,
:mod:`freetoken.serve.responses_api`) validate requests (``schemas``, ``anthropic_schemas``, ``responses_schemas``)
and share the way from a request to a job and back
(:mod:`freetoken.serve.jobs`); tools are rendered and the reply's calls parsed per template family
(:mod:`freetoken.serve.tool_use`, :mod:`freetoken.serve.tool_calls`); ``/`` is the chat page (``static/``) and
``/metrics`` the Prometheus metrics (:mod:`freetoken.serve.metrics`).
"""
