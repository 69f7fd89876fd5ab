"""Turning an input row into a prompt, or into a dead letter that says why not.

Pure functions (no Beam, no model): the template may use `{text}`, which is always the text
column (`--text-column`, whatever its name), and any other column by name; only plain names
are allowed, so a template cannot reach attributes (`{text.__class__}`).
"""

from __future__ import annotations

import functools
import re
import string
from dataclasses import dataclass
from typing import Any

from transforms.records import DeadLetter, InputRow, InvalidUtf8, PromptRow
from transforms.schema import ErrorType

# C0 and C1 control characters except tab, newline and carriage return (which real text uses).
CONTROL_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")
IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
MAX_ERROR_CHARS = 500
TEXT_FIELD = "text"  # the template field that always means the text column


@functools.lru_cache(maxsize=64)
def template_fields(template: str) -> tuple[str, ...]:
    """Column names a template uses, in order of first use. Raises ValueError for a malformed
    template or a field that is not a plain column name."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ValueError(f"prompt template {template!r} is malformed: {exc} (write literal braces as {{{{ and }}}})") from exc
    names: list[str] = []
    for _, name, spec, conversion in parsed:
        if name is None:
            continue
        if not IDENTIFIER.match(name) or spec or conversion:
            raise ValueError(
                f"prompt template field {{{name}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}} "
                "is not allowed: use plain column names like {text}"
            )
        if name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"prompt template {template!r} uses no column; it needs at least {{text}} or another column")
    return tuple(names)


@dataclass(frozen=True)
class PromptSpec:
    id_column: str = "id"
    text_column: str = "text"
    template: str = "{text}"
    keep_columns: tuple[str, ...] = ()
    strip_control_chars: bool = False

    @property
    def template_columns(self) -> tuple[str, ...]:
        return template_fields(self.template)

    def column_of(self, field: str) -> str:
        """The input column a template field reads: {text} is the text column."""
        return self.text_column if field == TEXT_FIELD else field

    def required_columns(self) -> list[str]:
        """Columns to read, in a stable order: id, text, template fields, kept columns."""
        ordered = [self.id_column, self.text_column, *map(self.column_of, self.template_columns), *self.keep_columns]
        return list(dict.fromkeys(ordered))


def text_fields(values: dict[str, str], text_column: str) -> list[str]:
    """The template fields of a rendered row that hold the text column."""
    return [f for f in (TEXT_FIELD, text_column) if f in values]


def clip(message: str) -> str:
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


def describe_control_chars(text: str) -> str:
    found = sorted({f"U+{ord(m.group()):04X}" for m in CONTROL_CHARS.finditer(text)})
    first = CONTROL_CHARS.search(text)
    return f"{', '.join(found[:5])}{' ...' if len(found) > 5 else ''} (first at character {first.start() if first else '?'})"


def has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def text_problem(column: str, value: Any) -> tuple[str, str] | None:
    """(error_type, message) when the text column's value cannot be a prompt."""
    if isinstance(value, InvalidUtf8):
        return ErrorType.INVALID_UTF8, f"column {column!r} holds bytes that are not valid UTF-8: {value.lossy()[:80]!r}"
    if value is None:
        return ErrorType.NULL_TEXT, f"column {column!r} is null"
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return ErrorType.INVALID_UTF8, f"column {column!r} holds bytes that are not valid UTF-8"
    if not isinstance(value, str):
        return ErrorType.NON_STRING_TEXT, f"column {column!r} holds a {type(value).__name__}, not a string: {value!r:.80}"
    if has_lone_surrogate(value):
        return ErrorType.INVALID_UTF8, f"column {column!r} holds unpaired surrogates (not encodable as UTF-8)"
    if not value.strip():
        return ErrorType.EMPTY_TEXT, f"column {column!r} is empty or whitespace only ({len(value)} characters)"
    return None


def field_value(value: Any) -> str | InvalidUtf8:
    """A template field's text: null becomes '', bytes are decoded, other values use str()."""
    if value is None:
        return ""
    if isinstance(value, (bytes, bytearray)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return InvalidUtf8(bytes(value))
    return value if isinstance(value, (str, InvalidUtf8)) else str(value)


def row_id(row: InputRow, spec: PromptSpec) -> Any:
    value = row.values.get(spec.id_column)
    return value.lossy() if isinstance(value, InvalidUtf8) else value


def render(template: str, values: dict[str, str]) -> str:
    return template.format_map(values)


def to_prompt(row: InputRow, spec: PromptSpec) -> PromptRow | DeadLetter:
    """Validate one row and render its prompt, or say why it cannot be a prompt."""
    rid = row_id(row, spec)

    def dead(error_type: str, message: str) -> DeadLetter:
        return DeadLetter(rid, row.shard, error_type, clip(message))

    if rid is None:
        return dead(ErrorType.NULL_ID, f"column {spec.id_column!r} is null")
    if isinstance(row.values.get(spec.id_column), InvalidUtf8):
        return dead(ErrorType.INVALID_UTF8, f"column {spec.id_column!r} holds bytes that are not valid UTF-8")
    problem = text_problem(spec.text_column, row.values.get(spec.text_column))
    if problem:
        return dead(*problem)
    values: dict[str, str] = {}
    for name in spec.template_columns:
        raw = row.values.get(spec.column_of(name))
        value = field_value(raw)
        if isinstance(value, InvalidUtf8):
            return dead(ErrorType.INVALID_UTF8, f"column {name!r} holds bytes that are not valid UTF-8")
        if has_lone_surrogate(value):
            return dead(ErrorType.INVALID_UTF8, f"column {name!r} holds unpaired surrogates")
        values[name] = value
    dirty = [name for name, value in values.items() if CONTROL_CHARS.search(value)]
    if dirty and not spec.strip_control_chars:
        return dead(
            ErrorType.CONTROL_CHARACTERS,
            f"column {dirty[0]!r} contains control character(s) {describe_control_chars(values[dirty[0]])}; "
            "--strip-control-chars removes them instead",
        )
    if dirty:
        values = {name: CONTROL_CHARS.sub("", value) for name, value in values.items()}
        if any(not values[f].strip() for f in text_fields(values, spec.text_column)):
            return dead(ErrorType.EMPTY_TEXT, f"column {spec.text_column!r} is empty once control characters are removed")
    try:
        prompt = render(spec.template, values)
    except (KeyError, IndexError, ValueError) as exc:
        return dead(ErrorType.TEMPLATE_ERROR, f"template {spec.template!r} failed: {type(exc).__name__}: {exc}")
    kept = {c: (v.lossy() if isinstance(v, InvalidUtf8) else v) for c in spec.keep_columns for v in [row.values.get(c)]}
    return PromptRow(shard=row.shard, id=rid, prompt=prompt, template_values=values, kept=kept)
