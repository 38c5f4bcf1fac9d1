"""The anchor endpoints (not in the OpenAI or Anthropic APIs): ``POST /v1/anchors``, ``GET /v1/anchors``,
``DELETE /v1/anchors/{id}``.

An anchor (:mod:`freetoken.engine.reuse.anchors`) is the verified KV state of a prompt's start; a chat request that
names it (``anchor``) resumes from it instead of prefilling that start again. Chat requests make anchors at their
message boundaries by themselves; ``POST /v1/anchors`` makes one on purpose, of

- ``{"messages": [...], "tools": [...]}`` (OpenAI chat messages and tools, ``tools`` optional): the conversation so
  far rendered as the start of a later chat request renders it (without the generation prompt), or
- ``{"prompt": "text"}`` or ``{"prompt": [token ids]}``: a prompt as ``/v1/completions`` reads it.

The prompt is prefilled (what the prefix cache or an anchor already holds of it is reused) and anchored whole; the
response is the anchor's listing (``id``, ``tokens``, ``tier``, ``on_disk``...) and ``cached_tokens``. Everything
runs on the engine's worker thread, in the queue's order (:class:`freetoken.serve.worker.EngineWorker`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from freetoken.serve.errors import APIError
from freetoken.serve.jobs import begin, collect, make_job, run_task, with_anchors
from freetoken.serve.openai_api import chat_tool_use, prompt_ids
from freetoken.serve.schemas import AnchorRequest

router = APIRouter()
ENDPOINTS = ("/v1/anchors",)


@router.post("/v1/anchors")
async def create_anchor(request: Request):
    state, body, worker = await begin(request, AnchorRequest)
    if body.messages is not None:
        use = chat_tool_use(worker.template, body)
        ids = worker.model.encode(use.render(worker.template, add_generation_prompt=False),
                                  add_special_tokens=False)
        param = "messages"
    else:
        use, ids, param = None, prompt_ids(worker.model, body.prompt), "prompt"
    job = make_job(state, ids, [], max_tokens=1, prompt_param=param)
    job.max_tokens = 0  # the prefill only
    if use is not None:  # and its message boundaries: an anchor there restores, new ones are made
        await with_anchors(worker, job, use)
    job.boundaries = sorted({*job.boundaries, len(ids)})  # the anchor of it all is the last one made
    _, outcome = await collect(worker, job, request)
    if not outcome.anchors_made or outcome.anchors_made[-1]["tokens"] != len(ids):
        raise APIError(500, "the anchor was not kept (the anchor store's budgets are too small for it)")
    return {**outcome.anchors_made[-1], "cached_tokens": outcome.cached_tokens}


@router.get("/v1/anchors")
async def list_anchors(request: Request):
    worker = request.app.state.server.ready()
    infos = await run_task(worker, lambda model: [a.info() for a in model.anchors.list()])
    return {"object": "list", "data": infos}


@router.delete("/v1/anchors/{aid}")
async def delete_anchor(request: Request, aid: str):
    worker = request.app.state.server.ready()
    if not await run_task(worker, lambda model: model.anchors.delete(aid.lower())):
        raise APIError(404, f"no anchor {aid!r} (GET /v1/anchors lists them)", param="id", code="anchor_not_found")
    return {"id": aid.lower(), "object": "anchor", "deleted": True}
