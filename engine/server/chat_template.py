"""Chat templates: a conversation rendered to prompt text with the model's Jinja template.

The template comes from `--chat-template` (a file, or the template text itself) or else
from the tokenizer files of the checkpoint. Templates run in Jinja's immutable sandbox
with the helpers HF templates expect (`raise_exception`, `tojson`, `bos_token`, ...).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from kvferry.engine.server.errors import bad_request


def load_chat_template(option: str | None, tokenizer_template: str | None) -> str | None:
    """The template to use: `--chat-template` (a path or inline text) over the tokenizer's."""
    if option is None:
        return tokenizer_template
    path = Path(option).expanduser()
    if path.is_file():
        return path.read_text(encoding="utf-8")
    if "{{" in option or "{%" in option:
        return option
    raise ValueError(f"--chat-template {option!r} is neither a file nor a Jinja template")


class _TemplateRaise(Exception):
    """Raised by a template's `raise_exception(...)`: the conversation is invalid."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaise(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


@functools.lru_cache(maxsize=8)
def compile_template(source: str) -> Any:
    """A compiled template; ValueError when the source is not valid Jinja."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except jinja2.TemplateError as exc:
        raise ValueError(f"the chat template is not valid Jinja: {exc}") from exc


def render_chat(
    template: str | None,
    conversation: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    special_tokens: dict[str, str | None],
    extra: dict[str, Any] | None = None,
) -> str:
    """The prompt text of `conversation`; a 400 when the model has no template or the
    template refuses the conversation."""
    import jinja2

    if template is None:
        raise bad_request(
            "this model has no chat template, so /v1/chat/completions cannot format "
            "messages; start the server with --chat-template FILE or use /v1/completions",
            param="messages",
        )
    context = {**special_tokens, **(extra or {})}
    try:
        return compile_template(template).render(
            messages=conversation, add_generation_prompt=add_generation_prompt, **context
        )
    except _TemplateRaise as exc:
        raise bad_request(f"the chat template refused the messages: {exc}", "messages") from None
    except (jinja2.TemplateError, LookupError, TypeError, ValueError, AttributeError,
            ArithmeticError, RecursionError) as exc:
        # A template is user code: any error it raises is about these messages.
        raise bad_request(
            f"the chat template failed on these messages: {type(exc).__name__}: {exc}",
            param="messages",
        ) from None
