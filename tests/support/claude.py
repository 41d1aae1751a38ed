"""A fake Anthropic client: answers `messages.create` from a script of messages, keeps every request."""

from __future__ import annotations

import copy
import secrets

import anthropic

from tpu_agent.propose.claude import DEFAULT_MODEL


def message(content, stop="tool_use", tokens=(100, 50)) -> dict:
    return {"id": "msg_x", "type": "message", "role": "assistant", "model": DEFAULT_MODEL, "content": content,
            "stop_reason": stop, "stop_sequence": None, "usage": {"input_tokens": tokens[0], "output_tokens": tokens[1]}}


def use(name, data, ident=None) -> dict:
    return {"type": "tool_use", "id": ident or f"toolu_{name}_{secrets.token_hex(3)}", "name": name, "input": data}


class FakeClient:
    """Answers `messages.create` from a script; keeps a deep copy of every request."""

    def __init__(self, answers):
        self.answers, self.requests = list(answers), []
        self.messages = self

    def create(self, **kwargs):
        self.requests.append(copy.deepcopy(kwargs))
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return anthropic.types.Message.model_validate(answer)
