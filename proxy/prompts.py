"""The prompt text a request's routing is predicted from (pure).

Chat: the last user turn plus earlier turns as room allows (the same rule the
observer used to store training prompts, and the same text for OpenAI
content-part lists). Completions: the prompt string, or the strings of a
batch joined. Token-id prompts carry no text: None. A body whose fields have
the wrong shape is refused with a 400 naming the field, before anything else
happens; fields the proxy does not read are left to the backend to judge.
"""

from __future__ import annotations

from typing import Any

from reap_swap.planning.corpus import content_text, prompt_text
from reap_swap.server_ext.control.errors import HTTPError


def _bad(message: str, param: str) -> HTTPError:
    return HTTPError(400, message, "invalid_type", param)


def prompt_from_body(route: str, body: dict[str, Any]) -> str | None:
    if route.endswith("/chat/completions"):
        raw = body.get("messages")
        if raw is None:
            return None
        if not isinstance(raw, list):
            raise _bad(f"'messages' must be a list of message objects, got {type(raw).__name__}", "messages")
        msgs = []
        for i, m in enumerate(raw):
            if not isinstance(m, dict):
                raise _bad(f"'messages[{i}]' must be an object, got {type(m).__name__}", f"messages[{i}]")
            role, content = m.get("role", "user"), m.get("content")
            if not isinstance(role, str):
                raise _bad(f"'messages[{i}].role' must be a string", f"messages[{i}].role")
            if content is not None and not isinstance(content, (str, list)):
                raise _bad(f"'messages[{i}].content' must be a string or a list of content parts", f"messages[{i}].content")
            msgs.append({"role": role, "content": content_text(content)})
        msgs = [m for m in msgs if m["content"].strip()]
        if not msgs:
            return None
        if not any(m["role"] == "user" for m in msgs):
            return msgs[-1]["content"][-2000:]
        return prompt_text(msgs)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[-2000:] or None
    if prompt is not None and not isinstance(prompt, list):
        raise _bad(f"'prompt' must be a string or a list, got {type(prompt).__name__}", "prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)[-2000:]
    return None
