"""``freetoken serve``: the loaded model behind OpenAI- and Anthropic-compatible HTTP APIs (:mod:`freetoken.serve.app`).

One model, one worker thread that owns it: by default it batches up to ``--max-seqs`` requests in every step
(:mod:`freetoken.serve.batch_worker`, over the engine's step loop), the rest waiting in its queue; with
``--max-seqs 1`` it runs them one at a time (:mod:`freetoken.serve.worker`). The routes
(:mod:`freetoken.serve.openai_api`, :mod:`freetoken.serve.anthropic_api`, :mod:`freetoken.serve.responses_api`)
validate requests (``schemas``, ``anthropic_schemas``, ``responses_schemas``) and share the way from a request to a
job and back (:mod:`freetoken.serve.jobs`); tools are rendered and the reply's calls parsed per template family
(:mod:`freetoken.serve.tool_use`, :mod:`freetoken.serve.tool_calls`); ``/`` is the chat page (``static/``) and
``/metrics`` the Prometheus metrics (:mod:`freetoken.serve.metrics`).
"""
