"""A decoded sample (trainer/samples.py) as the turns of a conversation, each span marked trained
or not: what the episodes view draws.

The sample's ``segments`` cut its text where the loss mask changes; this cuts it again at the
chat template's tokens, in either template the project's tokenizers use:

    tiny tokenizers   <bos><|system|>S<|end|><|user|>U<|end|><|tool|>T<|end|><|assistant|>A
    ChatML (Qwen, SmolLM2)   <|im_start|>user\\nU<|im_end|>\\n<|im_start|>assistant\\nA<|im_end|>

A role token starts a turn of that role; every span keeps its segment's ``trained`` flag and
``version``, so a trained span is exactly what the loss trained. Spans are of kind "text",
"template" (the template's own tokens, never the model's words), "tool_call" (a <tool_call> or
<calc> the policy wrote). A turn's ``kind`` says what it is to the reader: "system", "user"
(the first prompt), "assistant", "tool" (a tool's answer: role tool, or <result>/<error> in a
user turn) or "observation" (the environment's later user turns). Invariant: the spans' texts
joined are the sample's text (the segments joined), nothing dropped or added.
"""

from __future__ import annotations

import re

ROLE = re.compile(r"<\|im_start\|>(system|user|assistant|tool)\n?|<\|(system|user|assistant|"
                  r"tool)\|>\n?")
TEMPLATE = re.compile(r"<\|im_end\|>\n?|<\|end\|>\n?|<\|endoftext\|>|<bos>|<eos>|<pad>|"
                      r"<s>|</s>")
TOOL_CALL = re.compile(r"<tool_call>.*?</tool_call>|<calc>.*?</calc>", re.DOTALL)
TOOL_ANSWER = re.compile(r"^\s*<(result|error)>")


def _spans(text: str, trained: bool, version) -> list[tuple[str, str, bool, object, str]]:
    """(kind, text, trained, version, role-or-"") pieces of one segment's text, cut at the
    template's tokens; a role token's piece carries the role it starts."""
    out, at = [], 0
    marks = sorted([(m.start(), m.end(), m.group(1) or m.group(2)) for m in ROLE.finditer(text)]
                   + [(m.start(), m.end(), "") for m in TEMPLATE.finditer(text)])
    for start, end, role in marks:
        if start < at:   # overlapping matches cannot happen in practice; keep text whole
            continue
        if start > at:
            out.append(("text", text[at:start], trained, version, ""))
        out.append(("template", text[start:end], trained, version, role))
        at = end
    if at < len(text):
        out.append(("text", text[at:], trained, version, ""))
    return out


def _tool_calls(span: dict) -> list[dict]:
    """A text span cut around the tool calls in it."""
    if span["kind"] != "text" or not TOOL_CALL.search(span["text"]):
        return [span]
    out, at = [], 0
    for m in TOOL_CALL.finditer(span["text"]):
        if m.start() > at:
            out.append({**span, "text": span["text"][at:m.start()]})
        out.append({**span, "kind": "tool_call", "text": m.group(0)})
        at = m.end()
    if at < len(span["text"]):
        out.append({**span, "text": span["text"][at:]})
    return out


def conversation(sample: dict) -> list[dict]:
    """[{role, kind, spans: [{kind, text, trained, version}], versions, trained_tokens?}] of
    ``sample`` (see the module docstring); a sample without segments is one untrained turn."""
    segments = sample.get("segments")
    if not isinstance(segments, list):
        segments = [{"trained": False, "text": str(sample.get("text") or "")}]
    turns: list[dict] = []

    def turn(role: str) -> dict:
        turns.append({"role": role, "spans": []})
        return turns[-1]

    current = None
    for seg in segments:
        if not isinstance(seg, dict):
            continue
        trained = bool(seg.get("trained"))
        for kind, text, tr, version, role in _spans(str(seg.get("text") or ""), trained,
                                                    seg.get("version")):
            if role:
                current = turn(role)
            elif current is None:
                current = turn("assistant" if tr else "prompt")
            span = {"kind": kind, "text": text, "trained": tr}
            if tr and version is not None:
                span["version"] = version
            current["spans"] += _tool_calls(span)
    # a turn of template tokens alone (a leading <bos>, an end token after the last turn)
    # joins its neighbour: the next turn, or the previous one at the end
    for k in range(len(turns) - 1, -1, -1):
        if len(turns) > 1 and all(s["kind"] == "template" for s in turns[k]["spans"]):
            if k + 1 < len(turns):
                turns[k + 1]["spans"][:0] = turns[k]["spans"]
            else:
                turns[k - 1]["spans"] += turns[k]["spans"]
            del turns[k]
    users = 0
    for t in turns:
        words = "".join(s["text"] for s in t["spans"] if s["kind"] == "text")
        t["versions"] = sorted({s["version"] for s in t["spans"] if "version" in s})
        t["trained"] = any(s["trained"] for s in t["spans"] if s["kind"] != "template")
        if t["role"] == "tool" or (t["role"] == "user" and TOOL_ANSWER.match(words)):
            t["kind"] = "tool"
        elif t["role"] == "user":
            t["kind"] = "user" if users == 0 else "observation"
            users += 1
        elif t["role"] == "prompt":
            t["kind"] = "user"
        else:
            t["kind"] = t["role"]
    return turns
