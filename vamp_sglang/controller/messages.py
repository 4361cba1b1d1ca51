"""The controller's wire messages: typed frozen dataclasses and one strict msgpack serializer.

A round has two phases. Phase 0 (`agree_min`): every follower sends a `Proposal` with the KV tokens
it can add, the leader answers with one `Decision`. Phase 1 (`all_ok`): every follower sends a
`Vote` saying whether its remap succeeded, the leader answers with one `Outcome`. `missing` lists
the ranks that did not answer in time, `mismatched` those that answered for another round under
the same id, so every rank can log the same line.

Every message names its round twice: `round_id` (its sequence) and `purpose` (the call site that
holds it, e.g. "remap/offload"). Ranks whose control flow strayed can hold different calls under
one id; the purpose tells them apart, so one rank's remap is never committed by another rank's
answer to some other question.

Decoding is strict because a message we misread could make one rank remap while another does not:
anything that is not exactly one known message with well-typed fields raises `MalformedMessage`,
which the controller treats as no answer. No pickle: msgpack maps of plain ints, bools and tuples.
"""

import dataclasses
import re
from dataclasses import dataclass

import msgpack

MAX_MESSAGE_BYTES = 4096  # a message is a few ints; anything larger is not ours
MAX_RANKS = 1024
PURPOSE = re.compile(r"[a-z0-9_./-]{0,32}")  # a short call-site name, never free text


class MalformedMessage(ValueError):
    """Bytes that are not exactly one well-formed controller message; the text says what is wrong."""


def is_purpose(value: object) -> bool:
    return isinstance(value, str) and PURPOSE.fullmatch(value) is not None


def _check_field(cls_name: str, name: str, kind: object, value: object) -> None:
    """Type and range check of one field; bool is not accepted as an int (msgpack keeps them apart)."""
    where = f"{cls_name}.{name}"
    if kind is bool:
        if not isinstance(value, bool):
            raise MalformedMessage(f"field {where} must be a bool (got {type(value).__name__})")
    elif kind is int:
        if not isinstance(value, int) or isinstance(value, bool):
            raise MalformedMessage(f"field {where} must be an int (got {type(value).__name__})")
        if value < 0:
            raise MalformedMessage(f"field {where} must be >= 0 (got {value})")
    elif kind is str:
        if not is_purpose(value):
            raise MalformedMessage(f"field {where} must match {PURPOSE.pattern} (got {value!r:.40})")
    elif kind == tuple[int, ...]:
        if not isinstance(value, tuple) or len(value) > MAX_RANKS:
            raise MalformedMessage(f"field {where} must be a tuple of ranks (got {type(value).__name__})")
        for item in value:
            _check_field(cls_name, name + "[]", int, item)
    else:  # a programming error in this module, not bad input
        raise TypeError(f"unsupported field type {kind!r} for {where}")


class _Message:
    """Validates every field on construction, so a bad message cannot be built, sent or decoded."""

    __slots__ = ()

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            _check_field(type(self).__name__, field.name, field.type, getattr(self, field.name))


@dataclass(frozen=True, slots=True)
class Proposal(_Message):
    """Follower -> leader, phase 0: the KV tokens this rank can add for the candidate groups."""

    round_id: int
    rank: int
    tokens: int
    purpose: str = ""


@dataclass(frozen=True, slots=True)
class Decision(_Message):
    """Leader -> followers, phase 0: the common token count (0 when any rank is in `missing` or
    `mismatched`)."""

    round_id: int
    tokens: int
    missing: tuple[int, ...] = ()
    mismatched: tuple[int, ...] = ()
    purpose: str = ""


@dataclass(frozen=True, slots=True)
class Vote(_Message):
    """Follower -> leader, phase 1: whether this rank's remap of the agreed count succeeded."""

    round_id: int
    rank: int
    ok: bool
    purpose: str = ""


@dataclass(frozen=True, slots=True)
class Outcome(_Message):
    """Leader -> followers, phase 1: commit only if every rank voted ok in time, else roll back."""

    round_id: int
    commit: bool
    missing: tuple[int, ...] = ()
    mismatched: tuple[int, ...] = ()
    purpose: str = ""


Message = Proposal | Decision | Vote | Outcome
MESSAGE_TYPES: dict[str, type[Message]] = {cls.__name__: cls for cls in (Proposal, Decision, Vote, Outcome)}
PHASE_OF: dict[type[Message], int] = {Proposal: 0, Decision: 0, Vote: 1, Outcome: 1}


def encode(message: Message) -> bytes:
    if type(message) not in PHASE_OF:
        raise TypeError(f"not a controller message: {type(message).__name__}")
    body = {field.name: getattr(message, field.name) for field in dataclasses.fields(message)}
    return msgpack.packb({"type": type(message).__name__, **body}, use_bin_type=True)


def decode(data: bytes) -> Message:
    """The one message in `data`, or MalformedMessage naming the first thing that is wrong."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise MalformedMessage(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES} bytes")
    try:
        raw = msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=True,
                              max_bin_len=0, max_ext_len=0, max_array_len=MAX_RANKS, max_map_len=16)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # what msgpack raises for bad bytes
        raise MalformedMessage(f"not a msgpack message ({exc!r})") from None
    if not isinstance(raw, dict):
        raise MalformedMessage(f"message must be a msgpack map (got {type(raw).__name__})")
    kind = raw.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise MalformedMessage(f"unknown message type {kind!r}; expected one of {', '.join(MESSAGE_TYPES)}")
    names = {field.name for field in dataclasses.fields(cls)}
    missing = sorted(names - raw.keys())
    extra = sorted(str(key) for key in raw.keys() - names - {"type"})
    if missing:
        raise MalformedMessage(f"{kind} is missing field {', '.join(missing)}")
    if extra:
        raise MalformedMessage(f"{kind} has unknown field {', '.join(extra)}")
    return cls(**{name: raw[name] for name in names})
