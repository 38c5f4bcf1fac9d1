"""Tool calls parsed out of generated text, per template family, whatever the pieces the text streams in."""

import json

import pytest

from freetoken.serve.tool_calls import (
    CallArgs,
    CallStart,
    Content,
    DeepSeekParser,
    HermesParser,
    Qwen3CoderParser,
    inject_history,
    make_parser,
    tool_format,
    tools_system_prompt,
)

PIECES = [1, 2, 3, 5, 7, 1000]


def _parse(parser_cls, text: str, piece: int):
    p = parser_cls()
    events = []
    for i in range(0, len(text), piece):
        events += p.feed(text[i:i + piece])
    events += p.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls, order = {}, []
    for e in events:
        if isinstance(e, CallStart):
            assert e.index == len(calls) and e.id.startswith("call_") and e.index not in calls
            calls[e.index] = [e.name, ""]
        elif isinstance(e, CallArgs):
            assert e.index in calls, "arguments before the call's name"
            calls[e.index][1] += e.fragment
        order.append(type(e).__name__)
    return content, [tuple(c) for c in calls.values()], events


HERMES = ('I will read it.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "src/a.py", "lines": [1, 20], '
          '"opts": {"raw": true}}}\n</tool_call>\n<tool_call>\n{"name": "grep", "arguments": {"pattern": "}"}}\n'
          '</tool_call>')


@pytest.mark.parametrize("piece", PIECES)
def test_hermes(piece):
    content, calls, events = _parse(HermesParser, HERMES, piece)
    assert content.strip() == "I will read it."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("read_file", {"path": "src/a.py", "lines": [1, 20], "opts": {"raw": True}}), ("grep", {"pattern": "}"})]
    if piece <= 3:  # streamed: the first call's arguments came in several fragments, after its name
        assert sum(isinstance(e, CallArgs) and e.index == 0 for e in events) > 3


@pytest.mark.parametrize("text, name, args", [
    ('<tool_call>{"arguments": {"q": 1}, "name": "search"}</tool_call>', "search", {"q": 1}),  # other key order
    ('<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', "now", {}),  # arguments as a JSON string
    ('<tool_call>\n{"name": "f", "parameters": {"x": "a\\"b"}}\n</tool_call>', "f", {"x": 'a"b'}),
])
@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_hermes_variants(text, name, args, piece):
    content, calls, _ = _parse(HermesParser, text, piece)
    assert content == "" and len(calls) == 1 and calls[0][0] == name and json.loads(calls[0][1]) == args


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_hermes_text_that_is_not_a_call_stays_text(piece):
    for text in ("a < b and <tool not a tag", "x <tool_call>not json</tool_call> y", "cut <tool_call>\n{\"na"):
        content, calls, _ = _parse(HermesParser, text, piece)
        assert calls == [] and content == text, (text, content)


@pytest.mark.parametrize("piece", [1, 3, 1000])
def test_hermes_call_cut_short_is_reported(piece):
    content, calls, _ = _parse(HermesParser, '<tool_call>\n{"name": "write", "arguments": {"path": "x', piece)
    assert content == "" and calls[0][0] == "write" and calls[0][1].startswith('{"path": "x')


QWEN3_CODER = ("Let me write it.\n<tool_call>\n<function=write_file>\n<parameter=path>\nsrc/a.py\n</parameter>\n"
               "<parameter=content>\ndef f():\n    return 1\n</parameter>\n<parameter=mode>\n644\n</parameter>\n"
               "</function>\n</tool_call>\n<tool_call>\n<function=list_dir>\n</function>\n</tool_call>")


@pytest.mark.parametrize("piece", PIECES)
def test_qwen3_coder(piece):
    content, calls, events = _parse(Qwen3CoderParser, QWEN3_CODER, piece)
    assert content.strip() == "Let me write it."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("write_file", {"path": "src/a.py", "content": "def f():\n    return 1", "mode": 644}), ("list_dir", {})]
    assert sum(isinstance(e, CallArgs) and e.index == 0 for e in events) == 4  # a fragment per parameter, then }


#: MiniMax-M2's template: several invokes in one block, string values as text, others as JSON.
MINIMAX = ('Both at once.\n<minimax:tool_call>\n<invoke name="read_file">\n<parameter name="path">src/a <b>.py'
           '</parameter>\n<parameter name="lines">[1, 20]</parameter>\n</invoke>\n<invoke name="now">\n</invoke>\n'
           '</minimax:tool_call>\nDone.<minimax:tool_call>no call here</minimax:tool_call>')


@pytest.mark.parametrize("piece", PIECES)
def test_minimax(piece):
    content, calls, events = _parse(make_parser("minimax").__class__, MINIMAX, piece)
    assert content == "Both at once.\n\nDone.<minimax:tool_call>no call here</minimax:tool_call>"
    assert [(n, json.loads(a)) for n, a in calls] == [("read_file", {"path": "src/a <b>.py", "lines": [1, 20]}),
                                                      ("now", {})]
    assert sum(isinstance(e, CallArgs) and e.index == 0 for e in events) == 3  # a fragment per parameter, then }


@pytest.mark.parametrize("piece", [1, 4, 1000])
def test_minimax_call_cut_short_is_reported(piece):
    text = '<minimax:tool_call>\n<invoke name="grep">\n<parameter name="pattern">TODO</parameter>\n'
    content, calls, _ = _parse(make_parser("minimax").__class__, text, piece)
    assert content == "" and [(n, json.loads(a)) for n, a in calls] == [("grep", {"pattern": "TODO"})]


DEEPSEEK = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}"
            "<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"tz\": \"CET\"}\n```"
            "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


@pytest.mark.parametrize("piece", PIECES)
def test_deepseek_v3_and_v3_1(piece):
    content, calls, _ = _parse(DeepSeekParser, DEEPSEEK, piece)
    assert content == "Checking."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def test_tool_format_of_templates():
    assert tool_format("{% for m in messages %}{{ m.content }}{% endfor %}") == "injected"
    assert tool_format("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}") == "hermes"
    assert tool_format("<tool_call>\\n<function=' + name + '>") == "qwen3_coder"
    assert tool_format("'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'") == "deepseek"
    assert tool_format("<|start|>assistant<|channel|>commentary") == "harmony"
    assert tool_format("'<tool_call>' + tc.name }}<arg_key>{{ k }}</arg_key>") == "glm45"
    assert tool_format("{{- '<minimax:tool_call>\\n' }}{{- '<invoke name=\"' + tc.name + '\">' }}") == "minimax"
    with pytest.raises(ValueError, match="'xml' form"):
        make_parser("xml")


def test_injected_history():
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    msgs = inject_history([
        {"role": "user", "content": "read a.py"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "read_file", "arguments": {"path": "a.py"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "print(1)"},
    ], tools)
    assert msgs[0] == {"role": "system", "content": tools_system_prompt(tools)}
    assert '"name": "read_file"' in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content":
                       '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\nprint(1)\n</tool_response>"}
    # what the model is asked to write is what the parser reads
    content, calls, _ = _parse(HermesParser, msgs[2]["content"], 2)
    assert content == "" and calls == [("read_file", '{"path": "a.py"}')]
    system_first = inject_history([{"role": "system", "content": "Be brief."}], tools)
    assert len(system_first) == 1 and system_first[0]["content"].startswith("Be brief.\n\n")


HARMONY = ("<|channel|>analysis<|message|>The user wants the weather. I should call get_weather.<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
           '{"city": "Paris", "days": 2}<|call|>')
HARMONY_FINAL = ("<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
                 "Hello! <b>How</b> can I help?")  # generation stops at <|return|>: the stop string is not in the text


@pytest.mark.parametrize("piece", PIECES)
def test_harmony(piece):
    from freetoken.serve.tool_calls import HarmonyParser

    content, calls, _ = _parse(HarmonyParser, HARMONY, piece)
    assert content == "" and [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris", "days": 2})]
    content, calls, _ = _parse(HarmonyParser, HARMONY_FINAL, piece)
    assert content == "Hello! <b>How</b> can I help?" and calls == []  # the analysis channel is not shown
    recipient_first = "<|start|>assistant to=functions.ls<|channel|>commentary json<|message|>{}<|call|>"
    assert _parse(HarmonyParser, recipient_first, piece)[1] == [("ls", "{}")]


def test_harmony_template_stops_at_the_turn_not_the_message():
    from freetoken.engine.generation.chat import ChatTemplate

    template = ChatTemplate("{% for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}"
                            "{% if m.role == 'assistant' %}<|return|>{% else %}<|end|>{% endif %}{% endfor %}"
                            "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
    assert template.stop_strings() == ["<|return|>", "<|call|>"]
    assert tool_format(template.source) == "harmony"


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
           "required": ["city"], "additionalProperties": False}
FORCED_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
                {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize("form, text, accepted", [
    ("hermes", '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>', True),
    ("hermes", '<tool_call>\n{"name":"get_weather","arguments":{"town":"Paris"}}\n</tool_call>', False),
    ("hermes", 'Sure! <tool_call>\n{"name":"now","arguments":{}}\n</tool_call>', False),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":"Paris"}'
                 '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', True),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n```json\n{}\n```'
                 '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', True),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>lookup<｜tool▁sep｜>{}'
                 '<｜tool▁call▁end｜><｜tool▁calls▁end｜>', False),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nSt. Ives <3\n</parameter>\n"
                    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>", True),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
                    "</tool_call>", True),  # days is optional
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n"
                    "</tool_call>", False),  # city is required
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>", False),  # days is a number
    ("qwen3_coder", "<tool_call>\n<function=now>\n</function>\n</tool_call>", True),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>St. Ives <3</arg_value>\n"
              "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>", True),
    ("glm45", "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
     False),  # city is required
    ("glm45", "<tool_call>now\n</tool_call>", True),
    ("minimax", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">St. Ives <3</parameter>\n'
                '<parameter name="days">3</parameter>\n</invoke>\n</minimax:tool_call>', True),
    ("minimax", '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="days">3</parameter>\n</invoke>\n'
                '</minimax:tool_call>', False),  # city is required
    ("minimax", '<minimax:tool_call>\n<invoke name="now">\n</invoke>\n</minimax:tool_call>', True),
    ("minimax", '<minimax:tool_call>\n<invoke name="lookup">\n</invoke>\n</minimax:tool_call>', False),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
                '{"city":"Oslo"}<|tool_call_end|><|tool_calls_section_end|>', True),
    ("kimi_k2", '<|tool_calls_section_begin|><|tool_call_begin|>functions.lookup:0<|tool_call_argument_begin|>{}'
                '<|tool_call_end|><|tool_calls_section_end|>', False),
    ("harmony", '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}', True),
    ("harmony", '<|channel|>final<|message|>It is sunny.', False),
])
def test_forced_call_grammars(form, text, accepted):
    """The grammar that forces a call accepts the form's calls of the given tools and nothing else, and what it
    accepts the form's parser reads as that call (checked on the bundled model's byte-level vocabulary)."""
    from llguidance import LLMatcher, LLTokenizer
    from tokenizers import Tokenizer

    from freetoken.engine.loading.load import DEFAULT_MODEL
    from freetoken.serve.tool_calls import forced_call_grammar

    tok = Tokenizer.from_file(str(DEFAULT_MODEL / "tokenizer.json"))
    matcher = LLMatcher(LLTokenizer(tok.to_str(), eos_token=0), forced_call_grammar(FORCED_TOOLS, None, form),
                        log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text, add_special_tokens=False).ids
    ok = all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
    assert ok == accepted, (text, matcher.get_error())
    if accepted:
        content, calls, _ = _parse(make_parser(form).__class__, text, 3)
        assert content == "" and len(calls) == 1 and calls[0][0] in ("get_weather", "now")


def test_forced_call_in_an_unknown_form_is_refused():
    from freetoken.serve.tool_calls import forced_call_grammar

    with pytest.raises(ValueError, match="'xml' tool-call form is not supported"):
        forced_call_grammar(FORCED_TOOLS, "now", "xml")


#: GLM-4.5's template writes a call as the name, then one key/value pair a line (a string value as its text, others
#: as JSON); several calls follow each other.
GLM45 = ("Let me look.\n<tool_call>read_file\n<arg_key>path</arg_key>\n<arg_value>src/a <b>.py</arg_value>\n"
         "<arg_key>lines</arg_key>\n<arg_value>[1, 20]</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call>"
         "<tool_call>ls</tool_call>")


@pytest.mark.parametrize("piece", PIECES)
def test_glm45(piece):
    from freetoken.serve.tool_calls import Glm45Parser

    content, calls, _ = _parse(Glm45Parser, GLM45, piece)
    assert content.strip() == "Let me look."
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("read_file", {"path": "src/a <b>.py", "lines": [1, 20]}), ("now", {}), ("ls", {})]


def test_glm45_renders_what_it_parses():
    """The GLM-4.5 template's own tool-call rendering (its macro, as the checkpoint's chat_template writes it) parsed
    back gives the calls it rendered."""
    from freetoken.engine.generation.chat import ChatTemplate
    from freetoken.serve.tool_calls import Glm45Parser

    source = ("{% for m in messages %}{% if m.role == 'assistant' %}{% for tc in m.tool_calls %}"
              "{% set tc = tc.function %}{{ '\\n<tool_call>' + tc.name }}\n"
              "{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
              "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>\n"
              "{% endfor %}</tool_call>{% endfor %}{% endif %}{% endfor %}")
    assert tool_format(source) == "glm45"
    calls = [{"name": "grep", "arguments": {"pattern": "def main", "max": 3, "flags": {"i": True}}},
             {"name": "cwd", "arguments": {}}]
    text = ChatTemplate(source).render([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": c} for c in calls]}], add_generation_prompt=False)
    _, parsed, _ = _parse(Glm45Parser, text, 4)
    assert [(n, json.loads(a)) for n, a in parsed] == [(c["name"], c["arguments"]) for c in calls]


KIMI = ("Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.now:1'
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>")


@pytest.mark.parametrize("piece", PIECES)
def test_kimi_k2(piece):
    from freetoken.serve.tool_calls import KimiK2Parser

    content, calls, _ = _parse(KimiK2Parser, KIMI, piece)
    assert content == "Let me check."
    assert [(n, json.loads(a)) for n, a in calls] == [("get_weather", {"city": "Paris"}), ("now", {})]
    assert tool_format("{{'<|tool_calls_section_begin|>'}}") == "kimi_k2"
