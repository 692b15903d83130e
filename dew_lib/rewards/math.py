"""MathReward: a completion's final answer compared with the reference as an exact rational.

The answer is the content of the last `\\boxed{...}` in the completion; a completion without any
`\\boxed` falls back to GSM8K's form, the rest of the line after the last `####`. When both appear
the box wins: it is the spec's rule, and `####` is only the fallback form. A last box that is
malformed (no closing brace within the answer limit) scores 0; an earlier box is not consulted.

Both sides are read the same way. Math delimiters and currency signs (`$`, `\\$`, `\\(`, `\\)`)
are dropped, `\\text{}`-style wrappers unwrapped, `\\dfrac`/`\\tfrac` read as `\\frac`, a trailing
period and a leading `x =` (when it is the only `=`) removed. A number is an optional sign, then
a decimal (thousands separators `,`, `{,}` or `\\,` in groups of three; `.5`, `18.00`) with an
optional `e` exponent or `\\times 10^{n}`, or a `\\frac{a}{b}` (or `\\frac12`); then optionally
`/ b`. What follows the number is its unit when it starts with a letter, `%` (also `\\%`) or a
degree sign; the two sides agree when the values are equal as fractions and the units are
written the same (spaces aside). Anything else (`\\pi/2`, `1,23`, `2^3`) is not a number, and
such answers agree only when their text, without spaces, is identical.

All work is bounded before any parsing: an answer longer than MAX_ANSWER_CHARS, braces nested
deeper than MAX_DEPTH, a literal with more than MAX_DIGITS digits or an exponent beyond
MAX_EXPONENT is refused (the completion scores 0; a reference raises ValueError). Locating the
answer is one reverse search over the completion. No signals, threads or processes: safe to call
from any thread, many at once.

Not here: symbolic equivalence (`x+1` vs `1+x`, `\\sqrt{2}` vs `2^{1/2}`), intervals, tuples and
matrices as values, unit conversion; CodeReward.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from fractions import Fraction
from typing import Any, NamedTuple

MAX_ANSWER_CHARS = 1_000
MAX_DEPTH = 16
MAX_DIGITS = 100
MAX_EXPONENT = 100

_WRAPPERS = ("\\text", "\\textbf", "\\textrm", "\\textit", "\\mathrm", "\\mathbf", "\\mbox",
             "\\operatorname")
_REPLACE = (
    ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""),
    ("\\displaystyle", ""), ("\\!", ""), ("\\$", ""), ("$", ""), ("\\(", ""), ("\\)", ""),
    ("\\[", ""), ("\\]", ""), ("\\%", "%"), ("\u2212", "-"), ("{,}", ","), ("\\,", "\u2009"),
    ("\\;", " "), ("\\:", " "), ("\\ ", " "), ("~", " "), ("^{\\circ}", "°"), ("^\\circ", "°"),
    ("\\circ", "°"), ("\\degree", "°"), ("\\cdot", "\\times"), ("×", "\\times"),
)
_ASSIGNMENT = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,15}\s*=\s*")
_SEPARATORS = (",", "\u2009")


class Answer(NamedTuple):
    """A read answer: `value` and `unit` when it is a number, otherwise only `text`."""

    value: Fraction | None
    unit: str
    text: str


@dataclasses.dataclass(frozen=True)
class MathReward:
    """`reward(data_source, completion, ground_truth, extra_info) -> 1.0 or 0.0`.

    `ground_truth` is a string (a bare answer, a `\\boxed{}` answer or a full GSM8K solution
    ending in `#### n`), an integer, a finite float (read through its shortest decimal, so 0.1
    means 1/10) or a Fraction. `data_source` and `extra_info` are accepted and ignored.
    """

    def __call__(self, data_source: Any, completion: str, ground_truth: Any,
                 extra_info: Any = None) -> float:
        if not isinstance(completion, str):
            raise TypeError(f"MathReward: completion must be a str, got "
                            f"{type(completion).__name__}")
        reference = read_reference(ground_truth)
        text = extract_answer(completion)
        if text is None:
            return 0.0
        return 1.0 if same_answer(read_answer(text), reference) else 0.0


def extract_answer(completion: str) -> str | None:
    """The last `\\boxed{}`'s content, else the rest of the line after the last `####`."""
    box = completion.rfind("\\boxed")
    if box >= 0:
        return _boxed(completion, box + len("\\boxed"))
    mark = completion.rfind("####")
    if mark < 0:
        return None
    line = completion[mark + 4: mark + 4 + MAX_ANSWER_CHARS + 1]
    end = line.find("\n")
    if end >= 0:
        line = line[:end]
    if len(line) > MAX_ANSWER_CHARS:
        return None
    return line.strip() or None


def read_reference(ground_truth: Any) -> Answer:
    """Read a reference answer; raise on one that no completion could ever match."""
    if isinstance(ground_truth, bool):
        raise TypeError("MathReward: ground_truth must be a str or a number, got a bool")
    if isinstance(ground_truth, numbers.Rational):
        value = Fraction(int(ground_truth.numerator), int(ground_truth.denominator))
        return Answer(value, "", str(ground_truth))
    if isinstance(ground_truth, numbers.Real):
        if not math.isfinite(ground_truth):
            raise ValueError(f"MathReward: ground_truth must be finite, got {ground_truth!r}")
        return Answer(Fraction(repr(float(ground_truth))), "", repr(float(ground_truth)))
    if not isinstance(ground_truth, str):
        raise TypeError(f"MathReward: ground_truth must be a str or a number, got "
                        f"{type(ground_truth).__name__}")
    text = ground_truth
    if "\\boxed" in text or "####" in text:
        text = extract_answer(text)
        if text is None:
            raise ValueError(f"MathReward: ground_truth {_preview(ground_truth)} has a \\boxed "
                             f"or #### answer that cannot be read (unclosed, nested deeper "
                             f"than {MAX_DEPTH} or longer than {MAX_ANSWER_CHARS} characters)")
    if len(text) > MAX_ANSWER_CHARS:
        raise ValueError(f"MathReward: ground_truth {_preview(ground_truth)} is longer than "
                         f"{MAX_ANSWER_CHARS} characters; give the answer alone")
    try:
        answer = _read(text)
    except _OverLimit as error:
        raise ValueError(f"MathReward: ground_truth {_preview(ground_truth)}: {error}") from None
    if answer.value is None and not answer.text:
        raise ValueError(f"MathReward: ground_truth {_preview(ground_truth)} holds no answer")
    return answer


def read_answer(text: str) -> Answer:
    """Normalize an answer and read it as a number with a unit, or as plain text.

    An answer beyond the limits reads as empty text, which matches nothing.
    """
    if len(text) > MAX_ANSWER_CHARS:
        return Answer(None, "", "")
    try:
        return _read(text)
    except _OverLimit:
        return Answer(None, "", "")


def same_answer(answer: Answer, reference: Answer) -> bool:
    if answer.value is not None and reference.value is not None:
        return answer.value == reference.value and answer.unit == reference.unit
    if answer.value is None and reference.value is None:
        return bool(answer.text) and answer.text == reference.text
    return False


# -- reading -------------------------------------------------------------------------------------


class _OverLimit(ValueError):
    """A number, exponent or nesting beyond the module's limits."""


def _read(text: str) -> Answer:
    cleaned = _clean(text)
    if cleaned is None:
        return Answer(None, "", "")
    squeezed = "".join(cleaned.split())
    parsed = _number(cleaned, 0, 0)
    if parsed is not None:
        value, end = parsed
        unit = "".join(cleaned[end:].split())
        if not unit or unit[0].isalpha() or unit[0] in "%°":
            return Answer(value, unit, squeezed)
    return Answer(None, "", squeezed)


def _preview(text: Any) -> str:
    text = str(text)
    return repr(text if len(text) <= 60 else text[:40] + "..." + text[-15:])


def _closing(text: str, start: int) -> int:
    """Index of the brace closing `text[start] == "{"` within MAX_ANSWER_CHARS.

    -1 when there is none; -2 when the braces nest deeper than MAX_DEPTH first.
    """
    depth = 0
    stop = min(len(text), start + MAX_ANSWER_CHARS + 2)
    index = start
    while index < stop:
        ch = text[index]
        if ch == "\\":
            index += 2
            continue
        if ch == "{":
            depth += 1
            if depth > MAX_DEPTH:
                return -2
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return index
        index += 1
    return -1


def _checked_closing(text: str, start: int) -> int:
    close = _closing(text, start)
    if close == -2:
        raise _OverLimit(f"braces nested deeper than {MAX_DEPTH}")
    return close


def _boxed(text: str, index: int) -> str | None:
    stop = min(len(text), index + MAX_ANSWER_CHARS)
    while index < stop and text[index] == " ":
        index += 1
    if index >= len(text):
        return None
    if text[index] == "{":
        close = _closing(text, index)
        if close < 0:
            return None
        return text[index + 1: close].strip() or None
    if text[index - 1] != " ":  # `\boxedfoo` is another command, not a box
        return None
    end = index
    while end < stop and not text[end].isspace() and text[end] != "$":
        end += 1
    return text[index:end] or None


def _unwrap(text: str) -> str | None:
    """Replace `\\text{...}` and friends by their content; None if a wrapper is unclosed."""
    for wrapper in _WRAPPERS:
        start = text.find(wrapper + "{")
        while start >= 0:
            open_ = start + len(wrapper)
            close = _checked_closing(text, open_)
            if close < 0:
                return None
            text = text[:start] + " " + text[open_ + 1: close] + " " + text[close + 1:]
            start = text.find(wrapper + "{", start)
    return text


def _clean(text: str) -> str | None:
    text = _unwrap(text)
    if text is None:
        return None
    for old, new in _REPLACE:
        text = text.replace(old, new)
    text = text.strip()
    for _ in range(MAX_DEPTH):  # a whole answer wrapped in braces: {5} -> 5
        if text.startswith("{") and _closing(text, 0) == len(text) - 1:
            text = text[1:-1].strip()
        else:
            break
    text = text.rstrip(" .\u2009").strip()
    if text.count("=") == 1:
        match = _ASSIGNMENT.match(text)
        if match:
            text = text[match.end():]
    return text.replace("\u2009", " ").strip() if not _has_grouped_digits(text) else text


def _has_grouped_digits(text: str) -> bool:
    return any(a.isdigit() and b == "\u2009" and c.isdigit()
               for a, b, c in zip(text, text[1:], text[2:]))


def _skip_spaces(text: str, index: int) -> int:
    while index < len(text) and text[index] in " \u2009":
        index += 1
    return index


def _number(text: str, index: int, depth: int) -> tuple[Fraction, int] | None:
    """A signed number (with an optional `/ b`) starting at `index`: (value, end) or None."""
    atom = _signed(text, index, depth)
    if atom is None:
        return None
    value, index = atom
    after = _skip_spaces(text, index)
    if after < len(text) and text[after] == "/":
        denominator = _signed(text, _skip_spaces(text, after + 1), depth)
        if denominator is None or denominator[0] == 0:
            return None
        value, index = value / denominator[0], denominator[1]
    return value, index


def _signed(text: str, index: int, depth: int) -> tuple[Fraction, int] | None:
    negative = False
    if index < len(text) and text[index] in "+-":
        negative = text[index] == "-"
        index = _skip_spaces(text, index + 1)
    if text.startswith("\\frac", index):
        parsed = _fraction(text, index + len("\\frac"), depth)
    else:
        parsed = _decimal(text, index)
    if parsed is None:
        return None
    value, index = parsed
    return (-value if negative else value), index


def _fraction(text: str, index: int, depth: int) -> tuple[Fraction, int] | None:
    if depth >= MAX_DEPTH:
        raise _OverLimit(f"fractions nested deeper than {MAX_DEPTH}")
    parts = []
    for _ in range(2):
        index = _skip_spaces(text, index)
        if index >= len(text):
            return None
        if text[index] == "{":
            close = _checked_closing(text, index)
            if close < 0:
                return None
            inner = text[index + 1: close].strip()
            parsed = _number(inner, 0, depth + 1)
            if parsed is None or inner[parsed[1]:].strip():
                return None
            parts.append(parsed[0])
            index = close + 1
        elif text[index].isdigit():  # \frac12
            parts.append(Fraction(int(text[index])))
            index += 1
        else:
            return None
    if parts[1] == 0:
        return None
    return parts[0] / parts[1], index


def _digits(text: str, index: int, grouped: bool) -> tuple[str, int]:
    """A run of digits; with `grouped`, thousands separators between groups of three."""
    start = index
    while index < len(text) and text[index].isdigit() and index - start <= MAX_DIGITS:
        index += 1
    digits = text[start:index]
    if not grouped or not 1 <= len(digits) <= 3:
        return digits, index
    while (index + 3 < len(text) and text[index] in _SEPARATORS
           and text[index + 1: index + 4].isdigit()
           and not (index + 4 < len(text) and text[index + 4].isdigit())
           and len(digits) <= MAX_DIGITS):
        digits += text[index + 1: index + 4]
        index += 4
    return digits, index


def _decimal(text: str, index: int) -> tuple[Fraction, int] | None:
    whole, index = _digits(text, index, grouped=True)
    fraction = ""
    if index < len(text) and text[index] == "." and index + 1 < len(text) \
            and text[index + 1].isdigit():
        fraction, index = _digits(text, index + 1, grouped=False)
    elif index < len(text) and text[index] == "." and whole:
        index += 1  # "5." reads as 5
    if not whole and not fraction:
        return None
    if len(whole) + len(fraction) > MAX_DIGITS:
        raise _OverLimit(f"a number with more than {MAX_DIGITS} digits")
    value = Fraction(int(whole or "0")) + (Fraction(int(fraction), 10 ** len(fraction))
                                           if fraction else 0)
    exponent = _exponent(text, index)
    if exponent is not None:
        power, index = exponent
        value *= Fraction(10) ** power
    return value, index


def _exponent(text: str, index: int) -> tuple[int, int] | None:
    """`e-3` or `\\times 10^{3}` at `index`: (power, end), or None when there is none."""
    if index < len(text) and text[index] in "eE":
        sign_at = index + 1
        if sign_at < len(text) and text[sign_at] in "+-":
            sign_at += 1
        digits, end = _digits(text, sign_at, grouped=False)
        if not digits:
            return None
        return _power(text[index + 1: sign_at], digits), end
    after = _skip_spaces(text, index)
    if not text.startswith("\\times", after):
        return None
    after = _skip_spaces(text, after + len("\\times"))
    if not text.startswith("10^", after):
        return None
    after += 3
    braced = after < len(text) and text[after] == "{"
    sign_at = after + 1 if braced else after
    start = sign_at
    if sign_at < len(text) and text[sign_at] in "+-":
        sign_at += 1
    digits, end = _digits(text, sign_at, grouped=False)
    if not digits:
        return None
    if braced:
        if end >= len(text) or text[end] != "}":
            return None
        end += 1
    return _power(text[start:sign_at], digits), end


def _power(sign: str, digits: str) -> int:
    if len(digits) > len(str(MAX_EXPONENT)) or int(digits) > MAX_EXPONENT:
        raise _OverLimit(f"an exponent beyond {MAX_EXPONENT}")
    return int(digits) * (-1 if sign == "-" else 1)
