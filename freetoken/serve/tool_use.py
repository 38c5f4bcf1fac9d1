"""A request's tools as the server acts on them, the same for the OpenAI and the Anthropic routes: each reads its own
tool definitions into OpenAI/HF function definitions (``{"type": "function", "function": {"name", "description",
"parameters"}}``), and :func:`tool_use` makes of them what the prompt and the reply need.

- The prompt: a template that writes tools gets them as its ``tools`` variable; one that knows none (the bundled
  model's) gets them described in a system message, with earlier calls and results as hermes text
  (:func:`freetoken.serve.tool_calls.inject_history`).
- The reply: the parser of the form the template's family writes calls in (:mod:`freetoken.serve.tool_calls`).
- A forced call (OpenAI ``required`` or a named function, Anthropic ``any`` or ``tool``): the grammar of one call in
  the template's form, as the job's constraint (:meth:`ToolUse.forced_call`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from freetoken.engine.generation.chat import message_boundaries
from freetoken.serve.errors import APIError
from freetoken.serve.jobs import grammar_constraint, render_chat
from freetoken.serve.tool_calls import forced_call_grammar, inject_history, make_parser, tool_format


@dataclass
class ToolUse:
    """What a request's tools make of its conversation and its reply (no tools: the conversation as it is)."""

    tools: list[dict]  # the function definitions the model is told of ([]: none, or tool_choice none)
    messages: list[dict]  # the conversation to render
    context: dict = field(default_factory=dict)  # more template variables (``tools``)
    parser: object = None  # the reply's tool-call parser (None: no tools, the reply is text)
    form: str = "injected"  # the template's tool-call form (freetoken.serve.tool_calls.tool_format)

    def render(self, template, add_generation_prompt: bool = True) -> str:
        return render_chat(template, self.messages, add_generation_prompt=add_generation_prompt, **self.context)

    def boundaries(self, template, model, ids: list[int]) -> list[int]:
        """The message boundaries of ``ids`` (this conversation rendered), each leading part of :attr:`messages`
        rendered as :meth:`render` does it (tools injected or as the template's variable)."""
        offsets, text = None, None
        token_offsets = getattr(model, "token_offsets", None)  # (a stand-in engine may have none: the slow path)
        for gen in (True, False) if token_offsets is not None else ():
            text = self.render(template, add_generation_prompt=gen)  # as the job rendered it, or continued
            offsets = token_offsets(text, ids)
            if offsets is not None:
                break
        return message_boundaries(template, self.messages, lambda t: model.encode(t, add_special_tokens=False), ids,
                                  full_text=text, offsets=offsets, **self.context)

    async def forced_call(self, worker, name: str | None = None):
        """The constraint of a reply that is one call (``name``: of that tool; None: of any of them)."""
        try:
            grammar = forced_call_grammar(self.tools, name, self.form)
        except ValueError as e:
            raise APIError(400, f"tool_choice: {e}", param="tool_choice", code="unsupported_parameter") from None
        return await grammar_constraint(worker, lambda: grammar, "tool_choice")


def tool_use(template, messages: list[dict], tools: list[dict]) -> ToolUse:
    """``messages`` (chat-template messages) and ``tools`` (function definitions) for ``template``; a template
    whose tool-call form no parser reads is a 400. A harmony (gpt-oss) reply is always parsed, tools or not: its
    reasoning channel is not the reply's content."""
    form = tool_format(template.source)
    if form == "harmony" and not tools:
        return ToolUse([], messages, parser=make_parser(form), form=form)
    if not tools:
        return ToolUse([], messages)
    try:
        parser = make_parser(form)
    except ValueError as e:
        raise APIError(400, f"tools: {e}", param="tools", code="unsupported_parameter") from None
    if form == "injected":  # the template knows no tools: we describe them and ask for the hermes form
        return ToolUse(tools, inject_history(messages, tools), parser=parser, form=form)
    return ToolUse(tools, messages, {"tools": tools}, parser, form)
