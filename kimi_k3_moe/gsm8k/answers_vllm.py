"""How vLLM's GSM8K CI script (tests/evals/gsm8k/gsm8k_eval.py) scores a reply,
plus a strict score of ours.

flexible: the script's only score. Commas removed, the last run of digits, read
          as a Python integer literal; the reference's label is read from its
          solution text the same way, and the two compare as integers. Signs and
          decimal points are not read ("-3" is 3, "2.5" is 5), and a run with a
          leading zero ("018") is no valid literal, so it counts as no answer.
strict:   ours, the script has none: the number after the first `####`
          (a `$` and spaces allowed before it, commas removed), compared by
          value with the reference's `#### N`: "18.00", "$18" and "18" are equal.

Both return the canonical answer string, or None for no answer.
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# A minus sign counts only where it cannot be a subtraction ("20-5" is 20 and 5).
_NUMBER = r"(?:(?<![\w)])-)?\d+(?:\.\d+)?"
_STRICT = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_DIGITS = re.compile(r"\d+")  # Unicode digits too, as the script's `regex` module matches them


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
    runs = _DIGITS.findall(reply.replace(",", ""))
    if not runs:
        return None
    last = runs[-1]
    # what ast.literal_eval accepts: ASCII digits, no leading zero unless all zeros
    if not last.isascii() or (last[0] == "0" and last.strip("0")):
        return None
    return str(int(last))


def gold_answer(answer_text: str) -> str:
    """The reference answer of a GSM8K record (its `#### N` line), canonical."""
    value = strict_answer(answer_text)
    if value is None:
        raise ValueError("answer has no '#### <number>' line")
    return value
