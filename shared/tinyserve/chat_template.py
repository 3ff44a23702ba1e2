"""Chat templates (``tokenizer_config.json`` / ``chat_template.jinja``), rendered the
way transformers' ``apply_chat_template(..., tokenize=False)`` renders them.

A template is a Jinja2 program over ``messages`` and ``add_generation_prompt``
plus the tokenizer's special tokens. It runs in jinja2's immutable sandbox with
``trim_blocks``/``lstrip_blocks``, the helpers templates expect
(``raise_exception``, a ``tojson`` that does not HTML-escape, ``strftime_now``,
``namespace``), and sees only plain copies of the caller's data.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping


@functools.lru_cache(maxsize=1)
def _chat_environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text (for training
        masks); we render just its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """`namespace()` that refuses underscore names, which could reach Python internals."""

        def __init__(*args, **kwargs):  # same signature trick as jinja2's Namespace
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                SafeNamespace.check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            SafeNamespace.check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")

    class SafeDict:
        """`dict(...)` and `dict.fromkeys(...)` without exposing the dict type itself."""

        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja2's own tojson escapes <, >, & and ' for HTML, which would change the prompt
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=SafeNamespace, dict=SafeDict(),
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    return _chat_environment().from_string(source)


def _plain(value: Any) -> Any:
    """A copy made only of JSON-like types, so a template cannot touch caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (str, int, float):  # subclasses (enums, ...) back to the base type
        if isinstance(value, kind):
            return kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return (list if isinstance(value, list) else tuple)(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _template_message(message: Mapping) -> dict:
    """Like transformers: drop None fields, and fill the names templates read reasoning under."""
    if not isinstance(message, Mapping):
        raise TypeError(f"chat messages must be dicts, got {message!r}")
    msg = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
    if reasoning is not None:
        msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
    return msg


def render_chat_template(source: str, messages: list[Mapping], add_generation_prompt: bool = True,
                         tools: list | None = None, documents: list | None = None,
                         **variables) -> str:
    """The prompt text of ``messages`` under the template ``source``; ``variables`` are
    the special tokens (``bos_token``, ``eos_token``, ...) and any extra template
    variables (e.g. ``enable_thinking``)."""
    return _compile_template(source).render(
        messages=[_template_message(m) for m in messages], tools=_plain(tools),
        documents=_plain(documents), add_generation_prompt=add_generation_prompt,
        **_plain(variables))


def read_chat_template(directory: Path, config: Mapping) -> str | None:
    """The default template: chat_template.jinja wins over tokenizer_config.json (as in transformers)."""
    templates = config.get("chat_template")
    if isinstance(templates, list):  # old format: [{"name": ..., "template": ...}]
        templates = {t["name"]: t["template"] for t in templates}
    if isinstance(templates, str):
        templates = {"default": templates}
    templates = dict(templates or {})
    if (directory / "chat_template.jinja").is_file():
        templates = {"default": (directory / "chat_template.jinja").read_text(encoding="utf-8")}
    return templates.get("default")
