"""The model every request derives from, and JSON integers."""

from __future__ import annotations

import itertools
import logging
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, model_validator

log = logging.getLogger(__name__)




def _json_integer(value: Any) -> Any:
    """A number with no fraction is an integer, as JSON Schema reads it (1.0 is 1); anything else goes on to
    the strict int check (which refuses strings, booleans and fractions)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Integer = Annotated[int, BeforeValidator(_json_integer)]


class OpenAIModel(BaseModel):
    """Base of every request: unknown fields are kept so they can be logged, then ignored. Strict, as the
    document's JSON Schema is: no string-to-number or number-to-boolean coercion."""

    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="after")
    def _log_ignored_fields(self) -> OpenAIModel:
        if self.model_extra:
            log.warning("ignored %s", ignored_fields(self.model_extra))
        return self


def ignored_fields(extra: dict[str, Any], shown: int = 5, longest: int = 40) -> str:
    """What the log says of a request's unknown fields: their count and the first few names, each cut and
    escaped (repr), so a request cannot write a huge or forged line (a newline in a name) into the log."""
    names = [repr(name[:longest]) + ("..." if len(name) > longest else "") for name in itertools.islice(extra, shown)]
    more = f" and {len(extra) - shown} more" if len(extra) > shown else ""
    return f"{len(extra)} unknown request field{'s' if len(extra) > 1 else ''}: {', '.join(names)}{more}"
