"""Chat templates: render a list of messages to prompt text the way transformers does.

transformers renders `chat_template` (a Jinja string stored in tokenizer_config.json) in a sandboxed
Jinja environment with trim_blocks and lstrip_blocks, the loop-control extension, a `tojson` filter
that does not escape HTML, and `raise_exception` / `strftime_now` globals; the template sees
`messages`, `tools`, `documents`, `add_generation_prompt` and the special tokens (`bos_token`,
`eos_token`, ...). This module builds the same environment so kiln's server renders prompts
identically without importing transformers.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from kiln.errors import KilnError

# ChatML, as Qwen2 uses it: the default for kiln tokenizers trained with <|im_start|> / <|im_end|>.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _raise_exception(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(template: str):
    """The compiled Jinja template (cached: servers render the same template for every request)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise KilnError(f"the chat template is not valid Jinja (line {e.lineno}): {e.message}") from e


def render_chat(
    messages: list[dict],
    template: str = CHATML,
    *,
    add_generation_prompt: bool = False,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **special_tokens: str | None,
) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) through `template`.

    `special_tokens` (bos_token=..., eos_token=...) are passed to the template as transformers does.
    """
    import jinja2

    for m in messages:
        if not isinstance(m, dict) or "role" not in m:
            raise KilnError(f"each chat message must be a dict with a 'role', got {m!r}")
    try:
        return compile_template(template).render(
            messages=messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **special_tokens,
        )
    except jinja2.exceptions.TemplateError as e:
        raise KilnError(f"the chat template failed: {e}") from e
