"""Pull the answer out of a GSM8K reply, two ways.

strict:   the number after the first `#### ` (lm-eval's "strict-match").
flexible: the last number anywhere in the reply (vLLM's gsm8k job and lm-eval's
          "flexible-extract"), after removing thousands commas.

Both return a canonical decimal string ("1250", "-3", "2.5") so that answers
compare by value: "18.00", "$18" and "18" are the same answer.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A minus sign counts only where it cannot be a subtraction ("20-5" is 20 and 5).
_NUMBER = r"(?:(?<![\w)])-)?\d+(?:\.\d+)?"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_ANY = re.compile(_NUMBER)


def canonical(number: str) -> str:
    """'1,250.00' -> '1250'; '-0' -> '0'; '2.50' -> '2.5'."""
    try:
        value = Decimal(number.replace(",", "").replace("$", "").strip())
    except InvalidOperation:
        raise ValueError(f"not a number: {number!r}") from None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def strict_answer(reply: str) -> str | None:
    match = _STRICT.search(reply.replace(",", ""))
    return canonical(match.group(1)) if match else None


def flexible_answer(reply: str) -> str | None:
    numbers = _ANY.findall(reply.replace(",", ""))
    return canonical(numbers[-1]) if numbers else None


def gold_answer(answer_text: str) -> str:
    """The reference answer of a GSM8K record (its `#### N` line)."""
    value = strict_answer(answer_text)
    if value is None:
        raise ValueError("answer has no '#### <number>' line")
    return value
