"""The prompt text a request's routing is predicted from (pure).

Chat: the last user turn plus earlier turns as room allows (the same rule the
observer used to store training prompts). Completions: the prompt string, or
the strings of a batch joined. Token-id prompts carry no text: None.
"""

from __future__ import annotations

from typing import Any

from reap_swap.planning.corpus import prompt_text


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") in ("text", "input_text"))
    return ""


def prompt_from_body(route: str, body: dict[str, Any]) -> str | None:
    if route.endswith("/chat/completions"):
        msgs = [
            {"role": str(m.get("role", "user")), "content": _content_text(m.get("content"))}
            for m in body.get("messages") or []
            if isinstance(m, dict)
        ]
        msgs = [m for m in msgs if m["content"].strip()]
        if not msgs:
            return None
        if not any(m["role"] == "user" for m in msgs):
            return msgs[-1]["content"][-2000:]
        return prompt_text(msgs)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt[-2000:] or None
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)[-2000:]
    return None
