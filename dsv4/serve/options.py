"""Request parameters every dialect checks the same way, and the prompt they all produce.

Values are checked as dsv4.sampling checks them (so the server, the CLIs and the Python API
agree on what is valid); a failed check is a 400 naming the parameter as the dialect spells it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..encoding import REASONING_EFFORTS, encode_segments
from ..errors import InputError
from ..sampling import Sampling, check_max_tokens, check_seed
from .errors import RequestError
from .tool_choice import Choice

MAX_STOPS = 16


def checked(param: str, check: Callable, *args):
    """check(*args), its InputError turned into a 400 naming `param`."""
    try:
        return check(*args)
    except InputError as error:
        raise RequestError(str(error), param=param) from None


def logit_bias(value) -> dict:
    """JSON's logit_bias (its keys are strings) as token id -> bias; the ranges are Sampling's to check."""
    if not isinstance(value, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to numbers", param="logit_bias")
    bias = {}
    for key, number in value.items():
        try:
            bias[int(key)] = number
        except ValueError:
            raise RequestError(f"logit_bias: {key!r} is not a token id", param="logit_bias") from None
    return bias


def sampling(body: dict, names: dict[str, str], vocab_size: Optional[int]) -> Sampling:
    """A Sampling from the body's parameters; `names` maps each parameter the dialect has to
    its Sampling field (temperature -> temp ...)."""
    given = {field: body[param] for param, field in names.items() if body.get(param) is not None}
    if "logit_bias" in given:
        given["logit_bias"] = logit_bias(given["logit_bias"])
    spell = {field: param for param, field in names.items()}.get
    for name, value in given.items():  # one at a time, so that the 400 names the parameter
        checked(spell(name), Sampling(**{name: value}).check, vocab_size, spell)
    return Sampling(**given)


def seed(body: dict) -> Optional[int]:
    return checked("seed", check_seed, body.get("seed"))


def max_tokens(body: dict, names: tuple[str, ...], default: Optional[int]) -> int:
    """The first of `names` the body sets, checked; `default` when none is (None: required)."""
    for name in names:
        if body.get(name) is not None:
            return checked(name, check_max_tokens, body[name], name)
    if default is None:
        raise RequestError(f"'{names[0]}' is required", param=names[0])
    return default


def stop_strings(value, param: str = "stop") -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value) or len(value) > MAX_STOPS:
        raise RequestError(f"'{param}' must be a string or a list of at most {MAX_STOPS} strings", param=param)
    return [s for s in value if s]


def boolean(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false", param=name)
    return value


def refuse_unsupported(body: dict, table: dict[str, tuple[Callable[[Any], bool], str]]) -> None:
    """A 400 for the first parameter of `table` (name -> (is it neutral?, refusal)) the body
    sets to something other than a neutral value: a parameter silently ignored would answer a
    question the client did not ask."""
    for param, (neutral, refusal) in table.items():
        if not neutral(body.get(param)):
            raise RequestError(refusal, param=param)


def effort(value, param: str) -> Optional[object]:
    """A reasoning effort as V4.1 takes it: low/high/max or 1..100; OpenAI's 'medium' is V4.1's
    default ('high'); None when not given."""
    if value is None:
        return None
    if value == "medium":
        return "high"
    if value in REASONING_EFFORTS or (type(value) is int and 1 <= value <= 100):
        return value
    raise RequestError(f"'{param}' must be one of none, low, medium, high, max or an integer 1..100, "
                       f"got {value!r}", param=param)


@dataclass
class Prompt:
    """What a dialect's request asks the model to continue: OpenAI-style messages (as
    dsv4.encoding takes them) and how to render them."""
    messages: list
    mode: str = "chat"                      # or "thinking"
    tools: Optional[list] = None            # OpenAI function tools, rendered in the system prompt
    response_format: Optional[dict] = None  # shown to the model (and enforced by a constraint)
    effort: Optional[object] = None
    param: str = "messages"                 # the parameter a rendering error names
    tool_choice: Choice = Choice()          # enforced by a grammar (tool_choice.py)

    def segments(self) -> list:
        try:
            return encode_segments(self.messages, self.mode, tools=self.tools,
                                   response_format=self.response_format, reasoning_effort=self.effort)
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise RequestError(f"invalid {self.param}: {error}", param=self.param) from None


@dataclass
class Limits:
    """How much to generate and where to stop."""
    max_tokens: int
    stops: list[str] = field(default_factory=list)
    sampling: Sampling = Sampling()
    seed: Optional[int] = None
