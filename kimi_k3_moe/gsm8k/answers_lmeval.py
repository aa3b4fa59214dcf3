"""How lm-eval's `gsm8k` task (version 3.0) scores a reply, from its task config.

strict-match:     the first match of `#### (\\-?[0-9\\.\\,]+)`, its group.
flexible-extract: the last match of `(-?[$0-9.,]{2,})|(-?[0-9]+)`, the group that matched.
Either is "[invalid]" when nothing matches. exact_match then removes, in this
order, every `,`, every `$`, everything up to the last `#### ` and a final `.`
from the extracted string and from the whole reference solution, lower-cases
both and compares the strings: no value comparison, so `18.00`, `$18` (strict)
and `018` are not `18`.
"""
from __future__ import annotations

import re

INVALID = "[invalid]"
STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
# exact_match's regexes_to_ignore, applied in this order to both sides
IGNORED = tuple(re.compile(p) for p in (",", r"\$", r"(?s).*#### ", r"\.$"))


def strict_match(reply: str) -> str:
    match = STRICT.search(reply)
    return match.group(1).strip() if match else INVALID


def flexible_extract(reply: str) -> str:
    matches = list(FLEXIBLE.finditer(reply))
    if not matches:
        return INVALID
    last = matches[-1]
    return next(g for g in last.groups() if g).strip()


def normalize(text: str) -> str:
    for pattern in IGNORED:
        text = pattern.sub("", text)
    return text.lower()


def exact_match(extracted: str, reference_solution: str) -> bool:
    return normalize(extracted) == normalize(reference_solution)
